"""Launch decisions without starting processes: torchrun's arguments for one and several
nodes, DeepSpeed-style hostfiles, and when train.py starts torchrun at all."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

import train
from engine.errors import UserError
from engine.launch import Launch, from_hostfile, read_hostfile, torchrun_args

ROOT = Path(__file__).resolve().parent.parent


def cfg_of(*argv: str):
    return train.build_config(train.parse_args(list(argv)))


def test_one_node_uses_a_standalone_rendezvous():
    args = torchrun_args(Launch(nproc_per_node=4), "train.py", ["--step", "1"])
    assert args == ["--nproc-per-node=4", "--max-restarts=0", "--standalone", "train.py",
                    "--step", "1"]


def test_several_nodes_pass_the_rendezvous_through():
    launch = Launch(nproc_per_node=8, nnodes=2, node_rank=1, master_addr="10.0.0.1",
                    master_port=29600, standalone=False)
    assert torchrun_args(launch, "train.py", []) == [
        "--nproc-per-node=8", "--max-restarts=0", "--nnodes=2", "--node-rank=1",
        "--master-addr=10.0.0.1", "--master-port=29600", "train.py"]


def test_hostfile_sets_nodes_master_and_this_nodes_rank(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"# cluster\nworker-0 slots=4\n{socket.gethostname()} slots=4  # me\n")
    assert read_hostfile(str(hostfile)) == [("worker-0", 4), (socket.gethostname(), 4)]
    launch = from_hostfile(str(hostfile), None, 29500)
    assert (launch.nnodes, launch.node_rank, launch.master_addr, launch.nproc_per_node) == \
        (2, 1, "worker-0", 4)
    assert from_hostfile(str(hostfile), 0, 29500).node_rank == 0


@pytest.mark.parametrize("text, message", [
    ("worker-0 4\n", "line 1: expected `hostname slots=N`"),
    ("a slots=2\nb slots=4\n", "same slots=N"),
    ("# nothing\n", "lists no hosts"),
    ("a slots=2\nb slots=2\n", "is not listed once; pass --node-rank"),
])
def test_bad_hostfile_is_one_line(tmp_path, text, message):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    with pytest.raises(UserError, match=message):
        from_hostfile(str(hostfile), None, 29500)


def test_a_node_rank_past_the_nodes_is_refused(tmp_path):
    """It would wait in the rendezvous for ever (or make ranks past WORLD_SIZE)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=2\nb slots=2\n")
    with pytest.raises(UserError, match="--node-rank 2: --hostfile .* lists 2 nodes"):
        from_hostfile(str(hostfile), 2, 29500)
    with pytest.raises(UserError, match="--node-rank 2: --nnodes 2 ranks the nodes 0 to 1"):
        train.check_launch(cfg_of("--deployment-type", "multi_node", "--nnodes", "2",
                                  "--node-rank", "2"))
    train.check_launch(cfg_of("--deployment-type", "multi_node", "--nnodes", "2",
                              "--node-rank", "1"))


def test_missing_hostfile(tmp_path):
    with pytest.raises(UserError, match="--hostfile .*cannot read it"):
        read_hostfile(str(tmp_path / "nope"))


def test_torchrun_starts_only_for_several_processes(monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert not train.needs_launcher(cfg_of())
    assert train.needs_launcher(cfg_of("engine.procs=2"))
    assert train.needs_launcher(cfg_of("--deployment-type", "single_node"))
    cfg = cfg_of("--deployment-type", "multi_node", "--nnodes", "2", "--node-rank", "1",
                 "--master-addr", "10.1.1.1", "--master-port", "29555")
    assert train.needs_launcher(cfg)
    assert (cfg.launch.nnodes, cfg.launch.node_rank, cfg.launch.master_addr,
            cfg.launch.master_port) == (2, 1, "10.1.1.1", 29555)
    monkeypatch.setenv("LOCAL_RANK", "0")   # inside torchrun: run, do not launch again
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not train.needs_launcher(cfg_of("engine.procs=2"))


def test_the_launchers_process_checks_a_run_without_the_training_stack(tmp_path):
    """Before torchrun starts the ranks, train.py checks and plans the run, and says so
    (every step, a reward function, a resumable directory) without importing transformers,
    peft or DCP: the ranks import them anyway, and the launcher would add their ~5 s to
    every start."""
    code = ("import sys, train\n"
            f"cfg = train.build_config(train.parse_args(['--output-dir', {str(tmp_path)!r}, "
            "'engine.procs=2', 'engine.device=cpu', 'ppo.reward_fn=steps.demo:score']))\n"
            "train.check_config(cfg)\n"
            "assert train.needs_launcher(cfg)\n"
            "import engine.launch\n"
            "engine.launch.run_torchrun = lambda where, script, argv: 0   # no ranks here\n"
            "assert train.launch(cfg, [], 'train.py') == 0\n"
            "heavy = [m for m in ('transformers', 'peft', 'torch.distributed.checkpoint', "
            "'torch.distributed.tensor') if m in sys.modules]\n"
            "print(heavy)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "launching 2 processes on this node through torchrun", "[]"], done.stdout


def test_every_process_group_gets_the_runs_timeout(monkeypatch):
    """engine.timeout_s bounds every collective: also those of groups made after the
    default one without a timeout of their own (ZeRO++'s node levels, FSDP2's hpZ mesh),
    which took c10d's default, 30 minutes on gloo. One rank of a torchrun-like job here."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from engine.runtime import setup_runtime
    from tests.harness.environment import free_port

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):   # restored after
        monkeypatch.setattr(c10d, name, getattr(c10d, name))
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    setup_runtime("cpu", "float32", timeout_s=7)
    try:
        assert c10d._get_default_timeout(dist.Backend.GLOO) == timedelta(seconds=7)
    finally:
        dist.destroy_process_group()


def test_a_single_process_on_cuda_n_makes_it_the_current_device(monkeypatch):
    """engine.device=cuda:1 without torchrun: Triton kernels and CUDA graphs run on the
    current device, so cuda:1 must become it (they ran on cuda:0's stream with cuda:1's
    pointers); a device the machine lacks is refused in one line. CUDA is faked here."""
    import torch

    from engine.errors import UserError
    from engine.runtime import setup_runtime

    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    assert setup_runtime("cuda:1", "float32").device == torch.device("cuda:1")
    assert current == [torch.device("cuda:1")]
    # plain "cuda": the current device as it is, named with its index (a tensor's device
    # has one, and torch.device("cuda") != torch.device("cuda:1"))
    assert setup_runtime("cuda", "float32").device == torch.device("cuda:1")
    assert current == [torch.device("cuda:1")]
    with pytest.raises(UserError, match=r"engine.device=cuda:2: this machine has 2 CUDA "
                                        r"devices \(cuda:0 to cuda:1\)"):
        setup_runtime("cuda:2", "float32")


@contextlib.contextmanager
def training_run(tmp_path: Path, procs: int, stderr=subprocess.DEVNULL):
    """A long step 1 started as a user would (train.py in a session of its own), yielded
    with its ranks' processes once training has started; whatever is left of it is killed
    after (the ranks have sessions of their own)."""
    psutil = pytest.importorskip("psutil")
    launcher = subprocess.Popen(
        [sys.executable, "train.py", "--step", "1", "--output-dir", str(tmp_path),
         f"engine.procs={procs}", "engine.device=cpu", "sft.epochs=100",
         "logging.progress=false"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
        start_new_session=True)
    ranks = []
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "step1").exists():   # training has started
            assert launcher.poll() is None and time.monotonic() < deadline, "no run started"
            time.sleep(0.5)
        ranks = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                 if "train.py" in " ".join(p.cmdline())]
        yield launcher, ranks
    finally:
        for process in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)


def test_ranks_stop_when_their_launcher_is_killed(tmp_path):
    """torchrun starts the ranks in sessions of their own: with the launcher killed outright
    (SIGKILL, the OOM killer) they trained on, racing a rerun for the output directory.
    Each rank now has the kernel stop it when its launcher dies."""
    psutil = pytest.importorskip("psutil")
    with training_run(tmp_path, procs=2) as (launcher, ranks):
        assert len(ranks) == 2
        launcher.kill()
        launcher.wait(timeout=10)
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks still running after their launcher died: {alive}"


@pytest.mark.parametrize("procs, signum, said", [
    (2, signal.SIGINT, "interrupted"),
    (1, signal.SIGTERM, "stopped by SIGTERM"),
], ids=["ctrl-c-of-torchrun", "kill-of-one-process"])
def test_a_stopped_run_says_in_one_line_what_the_same_command_does_next(
        tmp_path, procs, signum, said):
    """Ctrl-C of a torchrun job printed torchrun's SignalException traceback under each
    rank's KeyboardInterrupt traceback, exit 1; a kill (a scheduler's preemption) of one
    process ended it mid-line. Both now say what the same command does next, exit 128 +
    the signal, and leave no rank behind."""
    psutil = pytest.importorskip("psutil")
    with training_run(tmp_path, procs, stderr=subprocess.PIPE) as (launcher, ranks):
        assert len(ranks) == (procs if procs > 1 else 0)
        launcher.send_signal(signum)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 128 + signum, err
        assert err.splitlines()[-1:] == [
            f"train.py: {said}; run the same command to go on: step 1 resumes from its last "
            "checkpoint"] or err.splitlines()[-1:] == [
            f"train.py: {said}; run the same command to go on: step 1 runs again (stopped "
            "before its first checkpoint)"], err
        assert "Traceback" not in err and "death signal" not in err, err
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks still running: {alive}"


def test_signals_stop_the_run_where_they_have_their_default_action():
    """SIGTERM raises Stopped in the block and has its handler back after; a SIGHUP that
    nohup ignores stays ignored (raising on it would stop a run when its terminal closed)."""
    from engine.launch import Stopped, signals_stop_the_run

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with pytest.raises(Stopped) as stopped, signals_stop_the_run():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)   # ignored, as under nohup
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)   # the handler raises at the next bytecode, well before this ends
        assert stopped.value.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _failure(tmp_path: Path, rank: int, exitcode: int, message: str, error: str,
             timestamp: int):
    """torchrun's record of a rank that ended with `exitcode`, its error file as
    engine.launch.record_error writes it."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error-{rank}.json"
    path.write_text(json.dumps({"message": message, "error": error, "timestamp": timestamp}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode,
                          error_file=str(path))


@pytest.mark.parametrize("rank_0_said, printed", [
    ("no data for step 1", 0),        # every rank met it: rank 0 printed it already
    ("another error", 1)])            # rank 0's is not rank 1's: the launcher prints rank 1's
def test_an_error_every_rank_meets_is_printed_once_whichever_exits_first(
        tmp_path, monkeypatch, capsys, rank_0_said, printed):
    """Both ranks refuse the run and rank 1 exits first (the race that printed the data's
    refusal twice): rank 0 printed its own, so the launcher does not print rank 1's again,
    unless it is another error."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from engine import launch

    failures = {0: _failure(tmp_path, 0, 2, f"train.py: {rank_0_said}", rank_0_said, 20),
                1: _failure(tmp_path, 1, 2, "train.py: rank 1: no data for step 1",
                            "no data for step 1", 10)}

    def failing(args):
        raise ChildFailedError("train.py", failures)

    monkeypatch.setattr("torch.distributed.run.run", failing)
    assert launch.run_torchrun(Launch(nproc_per_node=2), "train.py", []) == 2
    err = capsys.readouterr().err
    assert err.count("train.py: rank 1: no data for step 1") == printed, err
    assert "train.py: rank 1 failed (exit code 2); its error is printed above" in err
