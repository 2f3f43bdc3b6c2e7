"""Row-seeded sampling (engine/generation.py): the noise behind row b's t-th token is a
function of (row seed, t, token) only, so answers do not depend on batch mates, padding or
ranks, while the samples still follow the warped softmax."""

from __future__ import annotations

import pytest
import torch

from engine.generation import RowSeededSampling, SamplingSettings, generate, row_uniforms
from engine.models import byte_tokenizer, load_causal_lm
from steps.tokenize import collate_prompts


def test_uniforms_are_a_pure_function_of_seed_step_and_token():
    seeds = torch.tensor([0, 1, 2**40 + 5])
    u = row_uniforms(seeds, step=3, vocab=1000)
    assert u.shape == (3, 1000) and ((u > 0) & (u < 1)).all()
    torch.testing.assert_close(row_uniforms(seeds[1:], 3, 1000), u[1:], rtol=0, atol=0)
    assert not torch.equal(row_uniforms(seeds, 4, 1000), u)          # another step
    assert (u[0] != u[1]).float().mean() > 0.99                      # another row
    pooled = row_uniforms(torch.arange(200), 0, 1000).flatten()
    assert abs(pooled.mean().item() - 0.5) < 0.005
    assert abs(pooled.var().item() - 1 / 12) < 0.002
    deciles = torch.histc(pooled, bins=10, min=0, max=1) / pooled.numel()
    assert (deciles - 0.1).abs().max() < 0.005


@pytest.mark.parametrize("sampling, expected", [
    (SamplingSettings(), torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]), 0)),
    (SamplingSettings(temperature=0.5),
     torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]) / 0.5, 0)),
    (SamplingSettings(top_k=2),
     torch.softmax(torch.tensor([2.0, 1.0, -torch.inf, -torch.inf, -torch.inf]), 0)),
])
def test_greedy_pick_after_the_noise_samples_the_warped_softmax(sampling, expected):
    rows = 40_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).expand(rows, -1)
    noisy = RowSeededSampling(sampling, torch.arange(rows), prompt_len=0)(
        torch.zeros(rows, 0, dtype=torch.long), logits)
    freq = torch.bincount(noisy.argmax(-1), minlength=5).float() / rows
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.01)


def test_an_answer_does_not_depend_on_its_batch():
    tok = byte_tokenizer()
    model = load_causal_lm("tiny-llama", tok, seed=3).eval()
    prompts = [tok(t)["input_ids"] for t in ("Hi", "Q: what is 2+2? A:", "Say something long")]
    seeds = torch.tensor([11, 22, 33])
    sampling = SamplingSettings(max_new_tokens=12)

    def answers(rows: list[int]) -> list[list[int]]:
        batch = collate_prompts([prompts[i] for i in rows], tok.pad_token_id)
        out = generate(model, batch["input_ids"], batch["attention_mask"], sampling,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       row_seeds=seeds[rows])
        width = batch["input_ids"].shape[1]
        return [[t for t in row.tolist() if t != tok.pad_token_id] for row in out[:, width:]]

    together = answers([0, 1, 2])
    assert [answers([i])[0] for i in range(3)] == together
    assert answers([2, 0]) == [together[2], together[0]]
    assert len({tuple(a) for a in together}) == 3  # random weights: three different answers
