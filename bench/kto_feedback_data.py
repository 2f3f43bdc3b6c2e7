"""Write the demo's step-3 pairs as unpaired feedback for data.feedback_path: one answer of
each pair, alone, labelled desirable where it was the chosen one (steps.demo.feedback_records).

    python bench/kto_feedback_data.py --seed 1234 --out feedback-1234.jsonl

The pairs are those a default demo run gives step 3 (data.demo_pairs 6000, data.split
2/4/4, the same seed), so a run on this file compares with KTO on those pairs.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from steps import demo  # noqa: E402
from steps.data import load_blend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--pairs", type=int, default=6000, help="data.demo_pairs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    shares = load_blend(["demo"], [2.0, 4.0, 4.0], args.seed,
                        demo_pairs=lambda: demo.make_pairs(args.pairs, args.seed, "digits"))
    records = demo.feedback_records(shares[2], args.seed)
    args.out.write_text("".join(json.dumps(record) + "\n" for record in records))
    print(f"{args.out}: {len(records)} records, {sum(r['label'] for r in records)} desirable")


if __name__ == "__main__":
    main()
