"""ddp_helpers.torchrun against real torchrun jobs on this machine (gloo, CPU)."""

from __future__ import annotations

import getpass
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from ddp_test_support import (
    REPO,
    at_line,
    clocks_start_when,
    in_native_call,
    rank_pids,
    wait_for_no_leftovers,
)

from ddp_helpers import JobFailedError, JobHungError, TorchrunError, launcher, torchrun
from ddp_helpers.outcome import Hang

pytestmark = pytest.mark.usefixtures("kernel_unchanged")

HELLO = """
    import json, os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    names = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "FOO")
    env = {k: os.environ.get(k) for k in names}
    print("plain line from", rank)
    print(json.dumps({"rank": rank, "sum": t.item(), "argv": sys.argv[1:], "cwd": os.getcwd(), **env}))
    print("to stderr from", rank, file=sys.stderr)
    dist.destroy_process_group()
"""

HANG = """
    import json, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(json.dumps({"rank": rank, "event": "ready"}), flush=True)
    if rank == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))
"""


def _plan(script: str, **options: object):
    """A launch planned as torchrun() plans it, without starting it."""
    return launcher.plan_launch(script, (), launcher.LaunchOptions(**options))


def test_records_lines_and_exit_codes(script, capsys):
    path = script(HELLO)
    result = torchrun(path, "--lr", 0.1, nproc_per_node=2, timeout=120)
    records = result.records()
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["sum"] == 3.0 and r["argv"] == ["--lr", "0.1"] for r in records)
    assert result.records(rank=1) == [records[1]]
    assert result.stdout[0][0] == "plain line from 0"  # non-JSON lines are kept, not parsed
    assert result.stderr[1] == ["to stderr from 1"]  # stderr kept apart from stdout
    assert result.exitcodes == {0: 0, 1: 0} and result.returncode == 0
    assert result.world_size == 2 and result.duration > 0
    assert result.command.startswith("torchrun --standalone") and "--nproc-per-node=2" in result.command
    out, err = capsys.readouterr()
    assert "[rank 0] plain line from 0\n" in out and "[rank 1] plain line from 1\n" in out
    assert "[rank 1] to stderr from 1\n" in err and "to stderr" not in out
    with pytest.raises(KeyError, match="no rank 5"):
        result.records(rank=5)


def test_live_shows_only_chosen_ranks_but_keeps_all(script, capsys):
    result = torchrun(script(HELLO), nproc_per_node=2, live=[1], timeout=120)
    out, err = capsys.readouterr()
    assert "[rank 1]" in out and "[rank 0]" not in out and "[rank 0]" not in err
    assert result.stdout[0][0] == "plain line from 0"


def test_env_and_cwd(script, tmp_path):
    script(HELLO, name="hello.py")
    result = torchrun("hello.py", cwd=tmp_path, env={"FOO": 3}, nproc_per_node=1, live=False, timeout=120)
    (record,) = result.records()
    assert record["FOO"] == "3" and os.path.realpath(record["cwd"]) == os.path.realpath(tmp_path)
    assert "FOO" not in os.environ


TEMP = """
    import json, tempfile
    import torch  # noqa: F401 -- as every script does
    print(json.dumps({"tempdir": tempfile.gettempdir()}))
"""


@pytest.mark.parametrize("warm", [True, False])
def test_a_launch_leaves_no_torchelastic_folder_and_the_script_gets_tmpdir(script, tmp_path, warm):
    """torch's agent makes a log folder per launch in the temporary folder and never removes it."""
    script(TEMP, name="temp.py")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    result = torchrun(
        "temp.py", cwd=tmp_path, env={"TMPDIR": tmp}, nproc_per_node=2, live=False, warm=warm, timeout=300
    )
    assert [r["tempdir"] for r in result.records()] == [str(tmp)] * 2  # as in a fresh interpreter
    left = sorted(p.name for p in tmp.iterdir())
    # torch keeps one cache folder per user there (any process importing torch makes it); none per launch
    assert set(left) <= {f"torchinductor_{getpass.getuser()}"}, left


def test_failure_names_first_failing_rank_with_its_traceback(script):
    path = script("""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        def load_batch(step):
            if dist.get_rank() == 1 and step == 1:
                raise ValueError("bad batch on purpose")
        for step in range(3):
            load_batch(step)
            dist.all_reduce(torch.ones(1))
    """)
    with pytest.raises(TorchrunError) as info:
        torchrun(path, nproc_per_node=2, live=False, timeout=120)
    err = info.value
    message = str(err)
    assert isinstance(err, JobFailedError) and isinstance(err, RuntimeError)
    assert err.rank == 1 and err.exitcode != 0 and not err.timed_out and err.hang is None
    assert message.startswith("rank 1 raised ValueError")
    assert "ValueError: bad batch on purpose" in message and "in load_batch" in message
    assert "_worker.py" not in message and "runpy" not in message  # only the user's frames
    assert len(message.splitlines()) <= 30
    assert err.result.exitcodes[0] != 0  # the other rank was stopped
    assert any("ValueError" in line for line in err.result.stderr[1])  # full logs kept


def test_failure_by_signal_is_named(script):
    path = script("""
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    with pytest.raises(TorchrunError) as info:
        torchrun(path, nproc_per_node=2, live=False, timeout=120)
    assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL
    assert str(info.value).startswith("rank 1 was killed by SIGKILL (exit code -9)")


def test_exit_code_without_exception(script):
    path = script("""
        import os, sys
        sys.exit(3 if os.environ["RANK"] == "0" else 0)
    """)
    with pytest.raises(TorchrunError) as info:
        torchrun(path, nproc_per_node=2, live=False, timeout=120)
    assert info.value.rank == 0 and info.value.exitcode == 3
    assert str(info.value).startswith("rank 0 exited with code 3")


def test_hang_is_killed_and_the_culprit_named(script):
    path = script(HANG)

    def at_their_places() -> bool:
        """Rank 1 sleeps at job.py:8; rank 0 is inside all_reduce's C++ wait, called at job.py:9."""
        pids = rank_pids(os.getpid(), path)
        return (
            len(pids) == 2
            and at_line(pids[1], "job.py", 8)
            and in_native_call(pids[0], "c10d::Work::wait", "all_reduce", at=("job.py", 9))
        )

    limit = 4
    # The 4 s count from the moment both ranks are at their places, not from the launch: however long a busy
    # machine takes to start them, the stack dumps find each rank where the assertions below say.
    with clocks_start_when(at_their_places), pytest.raises(TorchrunError) as info:
        torchrun(path, nproc_per_node=2, live=False, timeout=limit)
    err = info.value
    assert isinstance(err, JobHungError) and err.hang == Hang("timeout", limit), str(err)
    assert err.timed_out and err.stuck_ranks == [1], str(err)
    assert str(err).startswith(f"timed out after {limit} s; stuck: rank 1"), str(err)
    message = str(err)
    assert "rank 1 is busy at job.py:8" in message  # the sleeping line
    assert "rank 0 waits in torch.distributed `all_reduce` called at job.py:9" in message
    assert "job.py" in err.stacks[0] and "job.py" in err.stacks[1]
    assert [r["event"] for r in err.result.records()] == ["ready", "ready"]


def test_a_rank_that_leaves_early_is_pointed_out(script):
    path = script("""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            dist.barrier()
    """)
    with pytest.raises(TorchrunError) as info:
        torchrun(path, nproc_per_node=2, live=False, timeout=300)
    err = info.value
    # With gloo, a peer that exits closes its connections, so the waiting rank fails instead of hanging.
    assert not err.timed_out and err.rank == 0
    # Which words gloo uses depends on which of the two processes gets there first: "closed" when rank 1 read
    # rank 0's barrier message before it exited (its socket sends FIN), "reset" when that message arrived
    # after rank 1 stopped reading (closing a socket with unread data sends RST). Notebook 07 accepts both.
    assert re.search(r"Connection (closed|reset) by peer", str(err)), str(err)
    assert "rank 1 exited normally (code 0) while the others were still running" in str(err)


def test_mismatched_collectives_are_reported_diagnosis_first(script, capsys):
    path = script("""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        print("ready", flush=True)
        if dist.get_rank() == 0:
            dist.barrier()
        else:
            dist.recv(torch.zeros(1), src=0)
    """)

    def in_their_calls() -> bool:
        """Each rank inside its collective's C++ wait: rank 0 in barrier's, rank 1 in recv's (gloo's own)."""
        pids = rank_pids(os.getpid(), path)
        return (
            len(pids) == 2
            and in_native_call(pids[0], "c10d::Work::wait", "barrier", at=("job.py", 6))
            and in_native_call(pids[1], "c10d::ProcessGroupGloo::RecvWork::wait", "recv", at=("job.py", 8))
        )

    # The 3 s of silence count from the moment both ranks wait in their calls, not from their last line.
    with clocks_start_when(in_their_calls), pytest.raises(TorchrunError) as info:
        torchrun(path, nproc_per_node=2, stall_timeout=3)
    err = info.value
    assert isinstance(err, JobHungError) and err.hang == Hang("stall", 3), str(err)
    assert err.stuck_ranks == [0, 1], str(err)
    assert "different collectives" in str(err)
    # The cell shows the ranks' own lines and then the diagnosis: the stack dumps stay on .stacks.
    out, errout = capsys.readouterr()
    shown = (out + errout).splitlines()
    assert "[rank 0] ready" in shown and "[rank 1] ready" in shown, shown
    assert not any("most recent call first" in line for line in shown), shown
    assert all("most recent call first" in err.stacks[r] for r in (0, 1)), err.stacks
    assert len(shown) + len(str(err).splitlines()) <= 15, shown  # notebook 00's hang cell has this shape


def test_a_rank_reads_each_of_its_files_once_as_it_grows(tmp_path):
    """The launcher's one object per rank: stdout and stderr in whole lines, the status file parsed into
    events, each read from where the last look ended (a half-written line waits for its end). No process."""
    from ddp_helpers import _protocol as protocol
    from ddp_helpers._run_folder import RankFiles

    rank = RankFiles(str(tmp_path), 1, live=False)
    assert not rank.poll() and rank.pid() is None and not rank.printed and rank.pgids() == set()
    status, stdout = (Path(protocol.rank_file(str(tmp_path), 1, kind)) for kind in ("status", "stdout"))
    start = json.dumps({"event": "start", "pid": 42, "pgid": 40, "time": 1.0}) + "\n"
    status.write_text(start[:20])  # the worker wrapper is still writing the line
    assert not rank.poll() and rank.events == [] and rank.pid() is None
    with status.open("a") as f:
        f.write(start[20:])
    stdout.write_text("first\nsec")
    assert rank.poll() and rank.printed and rank.pid() == 42 and rank.stdout.lines == ["first"]
    with status.open("a") as f:  # a restart: a second attempt in a new process group
        f.write(json.dumps({"event": "start", "pid": 52, "pgid": 50, "time": 2.0}) + "\n")
        f.write(json.dumps({"event": "exit", "code": 0, "time": 3.0}) + "\n")
    with stdout.open("a") as f:
        f.write("ond, no newline")
    assert rank.pgids() == {40, 50} and rank.pid() == 52
    rank.finish()
    assert rank.stdout.lines == ["first", "second, no newline"] and rank.stderr.lines == []
    assert not rank.poll() and len(rank.events) == 3, "each event parsed once, also after the files are done"
    record = rank.evidence(agents_ok=True)
    assert (record.rank, record.started, record.exitcode, record.script_exit) == (1, True, 0, 0)


def _parent(tmp_path: Path, target: Path) -> subprocess.Popen:
    """A separate Python process that launches a hanging job, standing in for a notebook kernel."""
    # Like a kernel, it handles SIGINT itself: a process started in the background from a shell (`cmd &`, as a
    # benchmark may run the suite) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt.
    code = (
        "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"from ddp_helpers import torchrun\ntorchrun({str(target)!r}, nproc_per_node=2, timeout=300)\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_until_ready(proc: subprocess.Popen) -> None:
    ready = set()
    for line in proc.stdout:
        if '"event": "ready"' in line:
            ready.add(line.split("]")[0])
        if len(ready) == 2:
            return
    raise AssertionError(f"the job never became ready: {proc.stderr.read()}")


def test_interrupt_kills_every_process(script, tmp_path):
    proc = _parent(tmp_path, script(HANG))
    _wait_until_ready(proc)
    proc.send_signal(signal.SIGINT)
    # a safety net: the parent ends within seconds, even on a busy machine (below pytest-timeout's 600 s)
    _, err = proc.communicate(timeout=300)
    assert "KeyboardInterrupt" in err
    # One plain line before the traceback says so, and it is true.
    assert (
        "ddp_helpers: interrupted; all 2 rank(s) and their torchrun agent(s) were stopped, "
        "nothing is left running"
    ) in err, err
    assert err.index("ddp_helpers: interrupted") < err.index("KeyboardInterrupt"), err
    assert wait_for_no_leftovers(proc.pid, within=60) == []


def test_sigkilled_parent_leaves_no_orphans(script, tmp_path):
    proc = _parent(tmp_path, script(HANG))
    _wait_until_ready(proc)
    (warm,) = _warm_processes_of(proc.pid)  # the parent's warm process, which ends with it
    proc.kill()
    proc.wait()
    assert wait_for_no_leftovers(proc.pid, within=60) == []
    for _ in range(600):  # a safety net: it ends as soon as it reads the end of its stdin
        if not os.path.exists(f"/proc/{warm.pid}"):
            break
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{warm.pid}"), "the warm process outlived its kernel"
    assert not os.path.exists(warm.folder), f"{warm.folder} (the warm process's socket) outlived its kernel"


def _warm_processes_of(parent: int) -> list[SimpleNamespace]:
    """The warm processes a process started: pid and private folder (the socket's, the last argument)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")[:-1]
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and "ddp_helpers._warm" in argv:
            found.append(SimpleNamespace(pid=int(entry), folder=os.path.dirname(argv[-1])))
    return found


def test_eight_concurrent_launches(script):
    path = script(HELLO)
    results, errors = {}, []

    def launch(i: int) -> None:
        try:
            results[i] = torchrun(path, "--job", i, nproc_per_node=2, live=False, timeout=300)
        except Exception as e:  # collected and reported below
            errors.append(e)

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, result in results.items():
        assert [r["argv"] for r in result.records()] == [["--job", str(i)]] * 2
        assert all(r["sum"] == 3.0 for r in result.records())


def test_many_lines_arrive_complete_and_in_order(script):
    n = 200_000
    path = script(f"""
        import os, sys
        rank = os.environ["RANK"]
        sys.stdout.write("".join(f"{{rank}} {{i}}\\n" for i in range({n})))
        sys.stderr.write("".join(f"e{{rank}} {{i}}\\n" for i in range(1000)))
    """)
    result = torchrun(path, nproc_per_node=2, live=False, timeout=300)
    for rank in (0, 1):
        assert len(result.stdout[rank]) == n
        assert result.stdout[rank] == [f"{rank} {i}" for i in range(n)]
        assert result.stderr[rank] == [f"e{rank} {i}" for i in range(1000)]


def test_no_final_newline_and_invalid_utf8(script):
    path = script("""
        import sys
        sys.stdout.buffer.write(b"first\\n\\xff\\xfe broken\\r\\nlast without newline")
    """)
    result = torchrun(path, nproc_per_node=1, live=False, timeout=120)
    assert result.stdout[0] == ["first", "\ufffd\ufffd broken", "last without newline"]


def test_simulated_nodes_get_torchrun_ranks(script):
    result = torchrun(script(HELLO), nnodes=2, nproc_per_node=1, live=False, timeout=180)
    records = sorted(result.records(), key=lambda r: r["rank"])
    assert [r["RANK"] for r in records] == ["0", "1"]
    assert [r["LOCAL_RANK"] for r in records] == ["0", "0"]
    assert [r["GROUP_RANK"] for r in records] == ["0", "1"]
    assert {r["WORLD_SIZE"] for r in records} == {"2"} and {r["LOCAL_WORLD_SIZE"] for r in records} == {"1"}
    assert all(r["sum"] == 3.0 for r in records)
    assert "--nnodes=2" in result.command and "--rdzv-backend=c10d" in result.command


def test_torchrun_args_pass_through_for_restarts(script):
    path = script("""
        import json, os
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt == 0 and os.environ["RANK"] == "1":
            raise RuntimeError("first attempt fails")
        print(json.dumps({"rank": int(os.environ["RANK"]), "attempt": attempt}))
    """)
    result = torchrun(path, nproc_per_node=2, torchrun_args=["--max-restarts=1"], live=False, timeout=120)
    assert {(r["rank"], r["attempt"]) for r in result.records()} >= {(0, 1), (1, 1)}
    assert result.exitcodes == {0: 0, 1: 0}


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"nproc_per_node": 0}, ValueError, "nproc_per_node must be at least 1"),
        ({"stall_timeout": -1}, ValueError, "stall_timeout must be a positive number"),
        ({"nproc_per_node": "2"}, TypeError, "nproc_per_node must be a whole number"),
        ({"nproc_per_node": 2.5}, TypeError, "nproc_per_node must be a whole number"),
        ({"nproc_per_node": True}, TypeError, "nproc_per_node must be a whole number"),
        ({"nnodes": 0}, ValueError, "nnodes must be at least 1"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number"),
        ({"live": [3]}, ValueError, r"names rank\(s\) \[3\]"),
        ({"backend": "mpi"}, ValueError, "backend must be 'gloo', 'nccl'"),
        ({"cwd": "/no/such/folder"}, FileNotFoundError, "is not a folder"),
        ({"torchrun_args": "--max-restarts=1"}, TypeError, r"a list of flags.*\['--max-restarts=1'\]"),
        ({"torchrun_args": ["--max-restarts", 1]}, TypeError, "must hold strings"),
        ({"grace": -1}, ValueError, "grace must be a number of seconds, 0 or more"),
        ({"grace": float("inf")}, ValueError, "grace must be a number of seconds"),
        ({"env": ["NCCL_DEBUG=INFO"]}, TypeError, "env must be a dict"),
        ({"warm": "no"}, TypeError, "warm must be True or False"),
    ],
)
def test_bad_input_fails_fast(script, kwargs, error, match):
    path = script(HELLO)
    with pytest.raises(error, match=match):
        torchrun(path, **{"nproc_per_node": 1, **kwargs})


def test_missing_script_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"not found .*%%writefile"):
        torchrun("nowhere.py", cwd=tmp_path)


@pytest.mark.skipif(
    os.environ.get("CUDA_VISIBLE_DEVICES", "x") != "x" or Path("/dev/nvidia0").exists(),
    reason="this machine may have GPUs",
)
def test_nccl_without_gpus_gives_advice(script, monkeypatch):
    def no_python(*args, **kwargs):
        raise AssertionError(f"a fresh Python was started to count GPUs: {args}")

    monkeypatch.setattr(launcher.subprocess, "run", no_python)  # no GPU driver here: nothing to ask
    with pytest.raises(RuntimeError, match=r"backend='nccl' needs one GPU per rank.*backend='gloo'"):
        torchrun(script(HELLO), nproc_per_node=2, backend="nccl")


def test_the_warm_process_counts_the_gpus(script, monkeypatch):
    """Where a GPU driver exists, a warm launch asks the warm process (torch imported, counting through NVML
    without initialising CUDA), and a fresh Python only where NVML cannot tell (MIG; here: no NVIDIA library
    at all)."""
    from ddp_helpers import _warm

    asked, fresh = [], []
    real_count = _warm.WarmProcess.count_gpus
    monkeypatch.setattr(
        _warm.WarmProcess, "count_gpus", lambda self: asked.append(real_count(self)) or asked[-1]
    )
    monkeypatch.setattr(
        launcher.subprocess,
        "run",
        lambda *a, **k: fresh.append(a) or subprocess.CompletedProcess(a, 0, f"{torch_gpu_count()}\n", ""),
    )
    monkeypatch.setattr(launcher, "_may_have_gpus", lambda: True)
    monkeypatch.setattr(launcher, "_GPU_COUNTS", {})
    env = _plan(script(HELLO), backend="gloo", live=False).env  # a launch's own environment
    assert launcher._gpu_count(env, warm=True) == torch_gpu_count()
    assert asked == [torch_gpu_count() if _has_nvml() else None], asked
    assert len(fresh) == (asked == [None]), fresh
    assert launcher._gpu_count(env, warm=True) == torch_gpu_count() and len(asked) == 1, (
        "asked once per setting"
    )


def torch_gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _has_nvml() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_warns_when_ranks_exceed_cores(script, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    with pytest.warns(UserWarning, match="2 ranks on 1 CPU core"):
        result = torchrun(script(HELLO), nproc_per_node=2, live=False, timeout=120)
    assert result.returncode == 0


def test_backend_is_passed_to_the_script(script):
    path = script("""
        import json, os
        print(json.dumps({"backend": os.environ.get("DDP_BACKEND")}))
    """)
    assert torchrun(path, backend="gloo", live=False, timeout=300).records() == [{"backend": "gloo"}]


@pytest.mark.parametrize(
    "gpus, nproc, backend, expected",
    [
        (1, 2, None, "gloo"),  # one GPU, two ranks: NCCL would send rank 1 to a cuda:1 that does not exist
        (2, 2, None, None),  # one GPU per rank: the script chooses (NCCL)
        (0, 2, None, None),  # no GPU: the script chooses (gloo)
        (1, 2, "gloo", "gloo"),  # asked for: passed on as asked
    ],
)
def test_fewer_gpus_than_ranks_runs_on_gloo(script, monkeypatch, capsys, gpus, nproc, backend, expected):
    monkeypatch.delenv("DDP_BACKEND", raising=False)
    monkeypatch.setattr(launcher, "_gpu_count", lambda env, warm: gpus)
    monkeypatch.setattr(launcher, "_NOTED", set())
    job = _plan(script(HELLO), nproc_per_node=nproc, live=False, backend=backend, warm=False)
    assert job.env.get("DDP_BACKEND") == expected, job.env.get("DDP_BACKEND")
    noted = capsys.readouterr().out
    assert ("NCCL needs one GPU per rank" in noted) == (expected == "gloo" and backend is None), noted


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ddp_helpers", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_success_and_no_torch_in_parent(script, tmp_path):
    script(HELLO, name="hello.py")
    done = _cli("--nproc-per-node", "2", "--timeout", "120", "hello.py", "--x", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert '[rank 1] {"rank": 1, "sum": 3.0, "argv": ["--x", "1"]' in done.stdout
    parent_imports = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert parent_imports and not [line for line in parent_imports if "torch" in line]


def test_cli_failure_exit_code_and_message(script, tmp_path, monkeypatch, capsys):
    """Exit codes of ``python -m ddp_helpers``: 1 with the error's message for a failed or hung job, 2 for bad
    input. In-process: test_cli_success_and_no_torch_in_parent launches, test_diagnose checks the message."""
    from ddp_helpers import __main__ as cli
    from ddp_helpers.outcome import TorchrunResult

    done = TorchrunResult("torchrun fail.py", 1, 0.1, {0: []}, {0: []}, {0: 4})
    path = script("raise SystemExit(4)\n", name="fail.py")
    jobs = []

    def raising(error: TorchrunError):
        def run(job):
            jobs.append(job)
            raise error

        return run

    for error in (
        JobFailedError("rank 0 exited with code 4.", done, rank=0, exitcode=4),
        JobHungError(
            "timed out after 5 s; stuck: rank 0", done, hang=Hang("timeout", 5), stuck_ranks=[0], stacks={}
        ),
    ):
        monkeypatch.setattr(launcher, "run_launch", raising(error))
        assert cli.main(["--timeout", "5", str(path), "--x", "1"]) == 1
        assert f"ddp_helpers: {error}" in capsys.readouterr().err
    assert (
        jobs[0].plain_command.endswith("fail.py --x 1")
        and jobs[0].options.warm is False
        and jobs[0].options.timeout == 5
    ), jobs[0]
    monkeypatch.undo()
    # refused before any process starts
    assert cli.main(["--nproc-per-node", "0", str(tmp_path / "fail.py")]) == 2
    assert "nproc_per_node must be at least 1" in capsys.readouterr().err


def test_importing_the_package_does_not_import_torch():
    code = (
        "import sys, ddp_helpers, ddp_helpers.launcher, ddp_helpers.__main__; "
        "ddp_helpers.torchrun; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=300)


def test_describe_environment(capsys):
    from ddp_helpers import describe_environment

    info = describe_environment()
    out = capsys.readouterr().out
    assert info["torch"] in out and f"CPU cores: {os.cpu_count()}" in out
    assert info["backend"] == ("nccl" if info["gpu_count"] else "gloo")
    assert f"backend={info['backend']!r}" in out


def test_describe_environment_says_what_a_launch_gets(monkeypatch, capsys):
    """One GPU: a script alone picks NCCL, but a 2-rank launch runs on gloo (faked GPU: none here)."""
    import torch

    from ddp_helpers import describe_environment, environment

    monkeypatch.delenv("DDP_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Fake GPU")
    info = describe_environment()
    assert (info["backend"], info["device"], info["launch_backend"]) == ("nccl", "cuda", "gloo"), info
    assert (
        "The scripts pick backend='nccl' on device='cuda' with up to 1 rank(s) per node; a launch of 2 ranks "
        "per node runs on backend='gloo' and the CPU"
    ) in capsys.readouterr().out
    assert describe_environment(verbose=False, nproc_per_node=1)["launch_backend"] == "nccl"
    assert environment.launch_backend(2, 0) == ("gloo", None)  # no GPU: the scripts choose gloo themselves
    assert environment.launch_backend(2, 2) == ("nccl", None)
    assert environment.launch_backend(2, 1) == ("gloo", "gloo")  # handed to the ranks as DDP_BACKEND
    # the launcher refuses it first
    assert environment.launch_backend(2, 1, requested="nccl") == (
        "nccl",
        "nccl",
    )
    # DDP_BACKEND set: the scripts read it
    assert environment.launch_backend(2, 1, preset="nccl") == (
        "nccl",
        None,
    )


PROBE = """
    import json, logging, multiprocessing, multiprocessing.forkserver, multiprocessing.resource_tracker
    import os, random, signal, sys
    preloaded = "torch" in sys.modules  # warm: the warm process imported it before forking
    import torch
    try:  # a fork after CUDA was initialised cannot use CUDA: the warm agent must not have touched it
        torch.cuda.set_device(0)
        cuda = "ok"
    except Exception as e:  # whatever happened, it must be the same cold and warm
        cuda = f"{type(e).__name__}: {str(e).split('.')[0]}"
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT",
             "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
             "OMP_NUM_THREADS", "FOO")
    print(json.dumps({
        "rank": int(os.environ["RANK"]), "env": {k: os.environ.get(k) for k in names},
        "env_names": sorted(k for k in os.environ if not k.startswith(("DDP_HELPERS_", "JPY_", "PYTEST_"))),
        "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__, "file": __file__,
        "threads": torch.get_num_threads(), "process": multiprocessing.current_process().name,
        "parent": multiprocessing.parent_process() is None,
        "root_handlers": len(logging.getLogger().handlers),
        "sigterm": str(signal.getsignal(signal.SIGTERM)), "sigint": str(signal.getsignal(signal.SIGINT)),
        "unbuffered": sys.stdout.write_through, "random": random.random(), "torch_seed": torch.initial_seed(),
        "cuda": cuda, "cuda_available": torch.cuda.is_available(), "preloaded": preloaded,
        "comm": open("/proc/self/comm").read().strip(),  # what ps -o comm, top and pgrep show
        # how a DataLoader's workers would start, and the fork server and resource tracker a rank holds
        "start_method": multiprocessing.get_start_method(allow_none=True),
        "fork_server": [multiprocessing.forkserver._forkserver._forkserver_alive_fd,
                        multiprocessing.forkserver._forkserver._forkserver_pid],
        "resource_tracker": [multiprocessing.resource_tracker._resource_tracker._fd,
                             multiprocessing.resource_tracker._resource_tracker._pid],
    }))
"""


PARENT_THREADS = """
    import json, os
    with open(f"/proc/{os.getppid()}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    print(json.dumps({"parent_threads": threads}))
"""


def test_a_warm_rank_is_forked_from_a_process_with_one_thread(script, tmp_path):
    """A fork copies the locks other threads hold, and the agent runs several (the store servers, the
    keep-alive): a rank forked from it hung now and then in getaddrinfo, on the resolver's lock."""
    script(PARENT_THREADS, name="threads.py")
    result = torchrun("threads.py", cwd=tmp_path, nproc_per_node=2, live=False, warm=True, timeout=300)
    assert [r["parent_threads"] for r in result.records()] == [1, 1], result.records()


CRASH_WITH_WORKERS = """
    import json, multiprocessing, os, sys, time

    def watch_manager():  # a DataLoader worker's watchdog: it ends once the process that started it is gone
        manager, end = os.getppid(), time.monotonic() + 120
        while os.getppid() == manager and time.monotonic() < end:
            time.sleep(0.05)

    if __name__ == "__main__":
        rank = int(os.environ["RANK"])
        ctx = multiprocessing.get_context()  # what a DataLoader uses by default
        ctx.Process(target=watch_manager, daemon=True).start()
        print(json.dumps({"rank": rank, "start_method": ctx.get_start_method()}), flush=True)
        printed = sys.argv[1]  # made by rank 0 once its record is in its file; rank 1 crashes only then
        if rank == 0:
            open(printed, "w").close()
        else:
            while not os.path.exists(printed):
                time.sleep(0.05)
            sys.exit("rank 1 crashes")
        time.sleep(120)  # until torchrun stops this rank (SIGTERM): its worker is left to notice by itself
"""


def test_a_warm_launch_ends_when_a_crash_leaves_workers_behind(script, tmp_path):
    """A warm rank once inherited "forkserver" and the agent's fork server and resource tracker: its
    DataLoader workers then started from a fork server of their own, which their watchdog took for the rank,
    and held the agent's fds, so after a crash the agent waited for them for ever (08_train's restart hung
    its warm launch). It must fail as a cold launch does, with the same start method, and leave nothing."""
    script(CRASH_WITH_WORKERS, name="crash_with_workers.py")
    methods = {}
    for warm in (False, True):
        printed = tmp_path / f"rank0-printed-{warm}"  # rank 1 crashes once rank 0's record is written
        with pytest.raises(JobFailedError) as failed:
            torchrun(  # the timeout is a safety net (a cold launch imports torch three times)
                "crash_with_workers.py",
                printed,
                cwd=tmp_path,
                nproc_per_node=2,
                live=False,
                timeout=200,
                warm=warm,
            )
        assert failed.value.rank == 1, (warm, str(failed.value))
        records = failed.value.result.records()
        assert sorted(r["rank"] for r in records) == [0, 1], (warm, records)
        methods[warm] = [r["start_method"] for r in sorted(records, key=lambda r: r["rank"])]
    assert methods[True] == methods[False], methods
    assert wait_for_no_leftovers(os.getpid(), within=30) == []


def test_a_script_that_ends_with_os_exit_hangs_only_a_warm_launch(script, tmp_path):
    """The one known difference (README): torch's agent counts a forked rank done once it has its return
    value, which os._exit skips. When this fails, the difference is gone: update README's warm paragraph."""
    script(
        'import json, os\nprint(json.dumps({"rank": int(os.environ["RANK"])}), flush=True)\nos._exit(0)\n',
        name="exit_now.py",
    )
    cold = torchrun("exit_now.py", cwd=tmp_path, nproc_per_node=2, live=False, warm=False, timeout=300)
    assert cold.exitcodes == {0: 0, 1: 0}
    with pytest.raises(JobHungError):
        torchrun("exit_now.py", cwd=tmp_path, nproc_per_node=2, live=False, warm=True, timeout=10)
    assert wait_for_no_leftovers(os.getpid(), within=30) == []


def test_warm_and_cold_launches_give_a_script_the_same_world(script, tmp_path):
    script(PROBE, name="probe.py")
    runs = {
        warm: torchrun(
            "probe.py",
            "--lr",
            1,
            cwd=tmp_path,
            env={"FOO": "bar"},
            nproc_per_node=2,
            live=False,
            timeout=300,
            warm=warm,
        ).records()
        for warm in (False, True)
    }
    cold, warm = runs[False], runs[True]
    for key in ("random", "torch_seed"):  # every process draws its own random numbers, warm or cold
        assert len({r.pop(key) for r in cold + warm}) == 4, (key, cold, warm)
    # warm=False is a fresh torchrun (its ranks import torch), warm=True forks from the warm process.
    assert [r.pop("preloaded") for r in cold + warm] == [False, False, True, True], (cold, warm)
    for c, w in zip(cold, warm, strict=True):
        assert c == w, (c, w)
    assert (
        cold[0]["process"] == "MainProcess"
        and cold[0]["env"]["OMP_NUM_THREADS"] == "1"
        and cold[0]["threads"] == 1
    )
    # warm too: a rank is findable by name
    assert [r["comm"] for r in cold] == ["rank0 probe", "rank1 probe"], cold


def test_warm_falls_back_to_cold_when_env_sets_an_import_time_variable(script, capsys):
    """A launch whose env= sets a variable torch reads at import runs cold, with a note (that warm=False
    really is a fresh process is test_warm_and_cold_launches_give_a_script_the_same_world's)."""
    job = _plan(script(HELLO), env={"TORCH_CPP_LOG_LEVEL": "INFO"}, live=False)
    assert not job.warm_now and job.env["TORCH_CPP_LOG_LEVEL"] == "INFO"
    assert "env= sets TORCH_CPP_LOG_LEVEL, which torch reads when it is imported" in capsys.readouterr().out
    assert _plan(script(HELLO), env={"FOO": "1"}, live=False).warm_now
    assert not _plan(script(HELLO), env={"TORCH_CPP_LOG_LEVEL": "INFO"}, warm=False).warm_now
    assert capsys.readouterr().out == "", "no note when the caller asked for a cold launch anyway"


def test_a_run_time_variable_keeps_the_launch_warm(script, capsys):
    """05's restart remedy is read by torch at run time: a launch setting it stays warm, the rank sees it."""
    path = script("""
        import json, os, sys
        value = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
        print(json.dumps({"warm": "torch" in sys.modules, "value": value}))
    """)
    result = torchrun(path, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, live=False, timeout=120)
    assert result.records() == [{"warm": True, "value": "1"}], result.records()
    assert "reads when it is imported" not in capsys.readouterr().out


def test_run_time_variables_are_read_only_inside_functions_of_torch():
    """What makes a variable safe to change per warm launch: torch reads it in a function, never at import."""
    import ast
    import importlib.util

    from ddp_helpers import _warm

    torch_dir = Path(importlib.util.find_spec("torch").origin).parent
    for name, source in _warm.RUN_TIME.items():
        tree = ast.parse((torch_dir / source).read_text())
        in_functions = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
        }
        reads = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == name]
        assert reads and all(id(n) in in_functions for n in reads), (
            f"{name}: read outside a function in {source}"
        )
        others = [
            p
            for p in torch_dir.rglob("*.py")
            if p != torch_dir / source and name in p.read_text(errors="ignore")
        ]
        assert not others, f"{name} is also named in {others}: check those reads too"
