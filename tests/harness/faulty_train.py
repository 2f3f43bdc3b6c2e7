"""train.py with one fault injected, for the distributed tests. RLHF_TEST_FAULT selects it:

  kill:<step>:<n>        every rank exits at once, as if the job were killed, right after
                         the n-th checkpoint of step <step> is complete
  raise:<rank>:<n>       rank <rank> raises at its n-th call of TrainEngine.step
  hang:<rank>:<n>        rank <rank> stops responding there instead (sleeps)
  refuse:<rank>          rank <rank> of the torchrun job refuses its config (a user error,
                         as a path missing on one node would be)

Run it like train.py; with several processes torchrun starts this file on every rank.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train  # noqa: E402
from engine import checkpoint, trainer  # noqa: E402


def _inject(fault: str) -> None:
    kind, *args = fault.split(":")
    if kind == "kill":
        step, n = f"step{args[0]}", int(args[1])
        save, saves = checkpoint.Checkpointer.save, []

        def save_then_die(self, *a, **kw):
            path = save(self, *a, **kw)
            if self.directory.parent.name == step:
                saves.append(path)
                if len(saves) == n:
                    os._exit(9)
            return path

        checkpoint.Checkpointer.save = save_then_die
    elif kind in ("raise", "hang"):
        rank, n = int(args[0]), int(args[1])
        step, calls = trainer.TrainEngine.step, []

        def faulty_step(self):
            calls.append(1)
            if self.runtime.rank == rank and len(calls) == n:
                if kind == "hang":
                    time.sleep(3600)
                raise RuntimeError(f"injected fault at optimizer step {n}")
            return step(self)

        trainer.TrainEngine.step = faulty_step
    elif kind == "refuse":
        check = train.check_config

        def refusing_check(cfg):
            if os.environ.get("RANK") == args[0]:
                raise train.UserError(f"injected refusal on rank {args[0]}")
            check(cfg)

        train.check_config = refusing_check
    elif kind:
        raise SystemExit(f"RLHF_TEST_FAULT={fault}: unknown fault")


if __name__ == "__main__":
    _inject(os.environ.get("RLHF_TEST_FAULT", ""))
    sys.exit(train.main(sys.argv[1:], script=__file__))
