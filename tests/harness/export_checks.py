"""A merged LoRA export leaves the live model as it was, at every ZeRO stage: exported
twice (the live adapters, then a copy of them as step 3 exports its EMA), both files equal
the base plus one delta and the live base is unchanged. At ZeRO-0 every rank holds the
whole model and the gathered state shares its storage: merging into it added the delta to
the live base, and the second export held it twice.

Run by tests/test_distributed.py: STAGE=0|3 TEST_RANKS=2 python tests/harness/export_checks.py OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.harness.ranks import run_ranks  # noqa: E402

KEY = "model.layers.0.self_attn.q_proj.weight"


def main() -> None:
    from safetensors.torch import load_file

    from engine.config import LoraConfig, OptimConfig
    from engine.lora import apply_lora
    from engine.models import byte_tokenizer, load_causal_lm
    from engine.parallel import ShardSettings
    from engine.runtime import setup_runtime
    from engine.trainer import TrainEngine

    out = Path(sys.argv[1])
    rt = setup_runtime(device="cpu", dtype="float32", seed=0)
    tok = byte_tokenizer()
    base = load_causal_lm("tiny-llama", tok, seed=0)
    expected = base.state_dict()[KEY].clone()
    model = apply_lora(base, LoraConfig(dim=4, only_optimize_lora=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)   # a delta the merge can see
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    expected += (q_proj.scaling["default"] * q_proj.lora_B["default"].weight
                 @ q_proj.lora_A["default"].weight).detach()
    engine = TrainEngine(model, OptimConfig(), total_steps=4, runtime=rt, lr=1e-3,
                         sharding=ShardSettings(zero_stage=int(os.environ["STAGE"])))

    def live_base() -> torch.Tensor:
        p = next(p for n, p in engine.module.named_parameters()
                 if "layers.0.self_attn.q_proj.base_layer.weight" in n)
        return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()

    before = live_base()
    engine.export(tok, out / "live")
    engine.export(tok, out / "copy", weights=engine.copy_weights(trainable_only=True))
    assert torch.equal(live_base(), before), "the export changed the live base"
    if rt.rank == 0:
        for name in ("live", "copy"):
            written = load_file(out / name / "model.safetensors")[KEY]
            torch.testing.assert_close(written, expected, msg=f"{name}: not base + one delta")


if __name__ == "__main__":
    run_ranks(main)
