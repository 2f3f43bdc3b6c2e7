"""The benchmark helpers whose output the README's tables are built from."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import step3_quality  # noqa: E402
import torch  # noqa: E402
from tensor_peak import TensorPeak  # noqa: E402


def _per_seed_file(path: Path, seed: int, figures: dict[str, float]) -> Path:
    path.write_text(f"command: python bench/step3_quality.py --seeds {seed}\ntask pick\n\n"
                    + step3_quality.table({seed: figures}, 16) + "\n")
    return path


def test_merge_joins_per_seed_files_into_one_table(tmp_path):
    """Seeds run as separate processes (and a seed's settings split over two) give the
    table one process over all seeds would print: the same rows, mean and sd."""
    seeds = {1234: {"best-of-n GT": 0.5, "[ppo] step 3 exported KL": 1.25},
             99: {"best-of-n GT": 0.75, "[ppo] step 3 exported KL": 1.5}}
    files = [_per_seed_file(tmp_path / "a.txt", 1234, seeds[1234]),
             _per_seed_file(tmp_path / "b.txt", 99, {"best-of-n GT": 0.75}),
             _per_seed_file(tmp_path / "c.txt", 99, {"[ppo] step 3 exported KL": 1.5})]
    merged = step3_quality.merge(files)
    assert merged.endswith(step3_quality.table(seeds, 16))
    rows = {" ".join(line.split()[:-5]): line.split()[-5:] for line in merged.splitlines()}
    # mean and sample sd of 0.5 and 0.75: 0.625, 0.25 / sqrt(2)
    assert rows["best-of-16 GT"] == ["0.500", "0.750", "0.625", "±", "0.177"]
    assert merged.count("command: ") == 3


def test_merge_refuses_seeds_with_different_measures(tmp_path):
    files = [_per_seed_file(tmp_path / "a.txt", 1234, {"best-of-n GT": 0.5, "rm accuracy": 0.9}),
             _per_seed_file(tmp_path / "b.txt", 99, {"best-of-n GT": 0.75})]
    with pytest.raises(SystemExit, match="seed 99 lacks 'rm accuracy'"):
        step3_quality.merge(files)
    (tmp_path / "empty.txt").write_text("command: nothing\n")
    with pytest.raises(SystemExit, match="no table in it"):
        step3_quality.merge([tmp_path / "empty.txt"])


def test_tensor_peak_counts_each_storage_once_while_it_lives():
    """Hand-counted: 4 MiB tensors made and freed, a view (no new bytes), an in-place op,
    a tensor made before the tracker (counted from its first use) and one resized by an
    out= op (recounted at its new size)."""
    mib = 2**20
    before = torch.ones(mib // 4)                           # 1 MiB, made outside
    with TensorPeak() as peak:
        x = torch.ones(mib)                                 # 4
        y = x * 2                                           # 8
        y.view(2, -1).add_(1)                               # 8: a view, in place
        del x                                               # 4
        z = y + before.repeat(4)                            # 4 + 1 + 4 (+4 for the repeat)
        assert peak.live == 9 * mib
        del z                                               # 5
        out = torch.empty(0)
        torch.add(y[: mib // 2], 1, out=out)                # out resized to 2 MiB: 7
        assert peak.live == 7 * mib
    assert peak.peak == 13 * mib and peak.summary()["itemised_peak_bytes"] == 13 * mib
    sites = peak.summary()["at_peak"]
    assert sum(sites.values()) == 13 * mib
    # by line, at the peak: y's, and z's with the repeat and `before` (first read there);
    # x was freed before it
    assert sorted(n // mib for site, n in sites.items() if "test_bench_tools" in site) \
        == [4, 9]
