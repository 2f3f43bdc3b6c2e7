"""GPU checks of bf16 training (run on a CUDA machine: `pytest tests/harness/bf16_checks.py`;
skipped elsewhere).

The root cause of bf16 step 3 going NaN on an H100: cuDNN's SDPA backward (PyTorch's
default attention kernel on Hopper since torch 2.11) returns NaN query gradients when a mask
is given, the sequence is 64 mod 128 tokens long and a query row's log-sum-exp is below
-88.7: the padding positions of a left-padded row attend to nothing, so theirs is -inf. The
demo's first rollout batch of exactly 64 tokens hit it (iteration 14). These checks show the
kernel's NaN on a plain forward/backward where this torch still has the bug, and that a
TrainEngine's forward (engine/precision.py: no cuDNN attention in differentiated forwards)
trains the same batch with finite gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.config import OptimConfig
from engine.models import byte_tokenizer, load_causal_lm, position_ids
from engine.runtime import Runtime
from engine.trainer import TrainEngine
from steps.rlhf import sft_loss

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

CUDA_BF16 = Runtime(device=torch.device("cuda"), dtype=torch.bfloat16)


def left_padded_batch(length: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """[4, length] token ids, rows left-padded by 0, 5, 17 and 30 positions."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (4, length), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 5, 17, 30)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids.cuda(), mask.cuda()


def gradients_finite(call, model, ids, mask) -> bool:
    logits = call(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    labels = ids.masked_fill(mask == 0, -100)
    sft_loss(logits, labels).backward()
    return all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("length", [64, 192])
def test_cudnn_attention_backward_is_what_went_nan(length):
    """The kernel bug itself, on a bf16 model: NaN gradients through cuDNN attention, finite
    ones through the other kernels. (Where a torch/cuDNN release fixed it, cuDNN is clean
    too: the test then only shows the others are.)"""
    ids, mask = left_padded_batch(length)
    for backends, expect_finite in (([SDPBackend.CUDNN_ATTENTION], None),
                                    ([SDPBackend.FLASH_ATTENTION,
                                      SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], True)):
        model = load_causal_lm("tiny-llama", byte_tokenizer(), seed=0,
                               dtype=torch.bfloat16).cuda()
        with sdpa_kernel(backends):
            finite = gradients_finite(model, model, ids, mask)
        if expect_finite is None:
            print(f"cuDNN attention, {length} tokens: gradients finite = {finite}")
        else:
            assert finite


@pytest.mark.parametrize("length", [64, 192])
def test_train_engine_bf16_gradients_are_finite(length):
    """The engine's trained forward in bf16 (fp32 master weights, autocast) on the batch
    that breaks cuDNN's backward: finite gradients, and the step is taken."""
    ids, mask = left_padded_batch(length)
    model = load_causal_lm("tiny-llama", byte_tokenizer(), seed=0)
    engine = TrainEngine(model, OptimConfig(), total_steps=2, runtime=CUDA_BF16, lr=1e-3)
    assert gradients_finite(engine, engine.module, ids, mask)
    assert engine.step() is not None and engine.skipped_steps == 0
