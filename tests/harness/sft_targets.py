"""What an SFT example trains on, as text: for tests of which tokens are targets."""

from __future__ import annotations

IGNORE_INDEX = -100


def target_texts(example, tokenizer) -> list[str]:
    """The texts of an SFT example's runs of labelled tokens (its targets), in order,
    special tokens written; each label is checked to be its input token."""
    runs, run = [], []
    for token, label in zip(example.input_ids, example.labels, strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            run.append(token)
        elif run:
            runs, run = [*runs, run], []
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in [*runs, run] if ids]
