"""The %ranks magics and the rank group behind them: the pure parts without processes, then real ranks (gloo
on the CPU) through IPython's InteractiveShell, and a real Jupyter kernel: its Interrupt, and its death."""

from __future__ import annotations

import os
import pickle
import signal
import textwrap
import threading
import time

import pytest
from ddp_test_support import clocks_start_when, in_native_call, in_python_call, wait_for_no_leftovers

from ddp_helpers import CellError, JobFailedError, JobHungError, _repl, launcher
from ddp_helpers import ranks as ranks_module
from ddp_helpers._run_folder import LineFollower
from ddp_helpers.outcome import Hang
from tests.interrupt_guard import interrupt_this_process

# ---- the pure parts --------------------------------------------------------------------------------------


def _run(code: str, namespace: dict | None = None) -> object:
    """Run a cell as a rank does, in-process: its statements, then its value (None without one)."""
    namespace = {} if namespace is None else namespace
    cell = _repl.split_cell(code, "<ranks cell 1>")
    exec(cell.body, namespace)
    return None if cell.last is None else eval(cell.last, namespace)


def test_a_cell_runs_its_statements_and_gives_its_last_expression():
    namespace = {}
    assert _run("x = 2\ny = x + 1\nx * y", namespace) == 6 and namespace["y"] == 3
    assert _run("x = 5", namespace) is None and namespace["x"] == 5  # a statement: no value
    assert _run("x + 1;", namespace) is None, "a semicolon keeps the value to itself, as in IPython"
    assert _run("x + 1  # a comment", namespace) == 6
    assert _run("if x:\n    z = 1\nz", namespace) == 1
    assert _run("", namespace) is None and _run("# only a comment\n", namespace) is None
    with pytest.raises(SyntaxError) as info:
        _repl.split_cell("x = (1,\n", "<ranks cell 7>")
    assert info.value.filename == "<ranks cell 7>"


def test_a_value_is_pickled_within_its_limit_or_refused_with_advice():
    import torch

    value = {"t": torch.arange(4.0), "n": [1, 2]}
    back = _repl.unpack_value(_repl.pack_value(value))
    assert torch.equal(back["t"], value["t"]) and back["n"] == [1, 2]
    with pytest.raises(_repl.ValueTooLarge) as info:
        _repl.pack_value(torch.zeros(1 << 18), limit=1 << 20)  # 1 MiB of floats, plus pickle's own bytes
    message = str(info.value)
    assert "a Tensor, pickles to more than 1,048,576 bytes" in message
    assert "--max-bytes" in message and "torch.save" in message
    assert len(_repl.pack_value(torch.zeros(1000), limit=1 << 20)) < 1 << 20
    for unpicklable, kind in ((threading.Lock(), "lock"), (lambda: 1, "function")):
        with pytest.raises(ValueError, match=rf"its value, a {kind}, cannot be pickled \(") as info:
            _repl.pack_value(unpicklable)
        assert "return plain data instead" in str(info.value)


def test_the_limit_stops_pickling_early():
    """A value far over the limit is not pickled whole first: the output refuses bytes past the limit."""
    sizes = []

    class Recorded(_repl._Bounded):
        def write(self, data: bytes) -> int:
            sizes.append(len(data))
            return super().write(data)

    with pytest.raises(_repl.ValueTooLarge):
        _repl._CpuPickler(Recorded(1000), protocol=pickle.HIGHEST_PROTOCOL).dump([b"x" * 600] * 10_000)
    assert sum(sizes[:-1]) <= 1000, "nothing beyond the limit was kept"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA (not on this machine)")
def test_a_cuda_tensor_comes_back_on_the_cpu():
    import torch

    back = _repl.unpack_value(_repl.pack_value({"g": torch.ones(3, device="cuda")}))
    assert back["g"].device.type == "cpu" and back["g"].tolist() == [1.0, 1.0, 1.0]


def _serve_in(namespace: dict) -> object:
    """A stand-in for the rank REPL's own frames above a cell: they must not show in its traceback."""
    return _repl.run_cell(
        {"cell": 1, "code": CODE, "filename": "<ranks cell 4>"}, namespace, _repl._Interrupts()
    )


CODE = "def load(step):\n    raise ValueError(f'bad batch {step}')\n\nload(3)\n"


def test_a_cells_traceback_starts_at_the_cell_and_shows_its_lines():
    reply = _serve_in({})
    assert reply["cell"] == 1 and reply["summary"] == "raised ValueError: bad batch 3"
    lines = reply["error"].splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1] == '  File "<ranks cell 4>", line 4, in <module>' and lines[2] == "    load(3)"
    assert '  File "<ranks cell 4>", line 2, in load' in lines
    assert "    raise ValueError(f'bad batch {step}')" in lines and lines[-1] == "ValueError: bad batch 3"
    assert "_repl.py" not in reply["error"] and "test_ranks.py" not in reply["error"], (
        "only the cell's frames"
    )


def test_a_rank_replies_with_its_value_or_what_went_wrong():
    interrupts = _repl._Interrupts()

    def reply(code: str, **extra: object) -> dict:
        message = {"cell": 2, "code": code, "filename": "<ranks cell 2>", **extra}
        return _repl.run_cell(message, namespace, interrupts)

    namespace = {"rank": 1}
    ok = reply("rank * 10")
    assert ok["type"] == "int" and _repl.unpack_value(__import__("base64").b64decode(ok["value"])) == 10
    assert reply("import sys\nsys.exit(3)")["summary"] == "raised SystemExit: 3", "a rank of a group stays"
    big = reply("b'x' * 5000", max_bytes=1000)
    assert big["summary"] == "its value, a bytes, pickles to more than 1,000 bytes, the limit"
    interrupted = reply("raise KeyboardInterrupt")
    assert interrupted["interrupted"] and "KeyboardInterrupt" in interrupted["error"]
    assert not interrupts.running
    interrupts(signal.SIGINT, None)  # between cells an interrupt is ignored: it came late


def test_an_interrupt_takes_effect_only_where_a_cell_waits_for_a_message(kernel_unchanged):
    """One that comes while a rank's reply is read waits for the next wait (reading on would lose or double
    a message); one that comes in the wait raises there, at once."""
    guard = ranks_module._SafeInterrupt()
    with guard:
        interrupt_this_process()  # Python runs the handler as the call returns: outside the wait
        assert guard.pending is not None, "noted, not raised"
        with pytest.raises(KeyboardInterrupt), guard.waiting():
            pass
        with pytest.raises(KeyboardInterrupt), guard.waiting():
            interrupt_this_process()
        assert guard.pending is None


def test_lines_without_a_newline_end_with_the_cell(tmp_path):
    path = tmp_path / "rank0.stdout"
    lines = LineFollower(str(path))
    path.write_bytes(b"one\ntwo, no newline yet")
    assert lines.poll() == ["one"] and lines.end_line() == ["two, no newline yet"]
    with path.open("ab") as f:
        f.write(b"three\n")
    assert lines.poll() == ["three"] and lines.lines == ["one", "two, no newline yet", "three"]


# ---- real ranks through IPython ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ddp_helpers")
    return shell


@pytest.fixture
def ranks(shell, kernel_unchanged):
    """A 2-rank group for one test: ``ranks(code, line="")`` runs a %%ranks cell and returns its value."""
    shell.run_line_magic("ranks", "start -n 2")

    def cell(code: str, line: str = "") -> object:
        return shell.run_cell_magic("ranks", line, textwrap.dedent(code))

    yield cell
    shell.run_line_magic("ranks", "stop")


def test_state_lasts_between_cells_and_each_rank_gives_its_value(shell, capsys, ranks):
    assert "2 rank(s) ready (gloo, cpu)" in capsys.readouterr().out
    assert ranks("x = torch.tensor([rank + 1.0])") is None, "a cell without a last expression shows nothing"
    assert ranks("dist.all_reduce(x)\nx.item()") == {0: 3.0, 1: 3.0}
    assert ranks("x.item(), world_size, local_rank, str(device)") == {
        0: (3.0, 2, 0, "cpu"),
        1: (3.0, 2, 1, "cpu"),
    }
    assert ranks("rank * 10", "--ranks 1") == {1: 10}
    assert ranks("y = rank", "--ranks 0") is None
    assert ranks("'y' in dir()") == {0: True, 1: False}, "each rank keeps its own namespace"
    result = shell.run_cell("%%ranks\nrank")
    assert result.success and result.result == {0: 0, 1: 1} and shell.user_ns["_"] == {0: 0, 1: 1}
    tensors = ranks("torch.arange(3) * rank")
    assert [t.tolist() for t in tensors.values()] == [[0, 0, 0], [0, 1, 2]]


def test_an_exception_on_one_rank_leaves_the_group_usable(ranks, capsys):
    with pytest.raises(CellError) as info:
        ranks("""
            def shard(r):
                return 10 // (r - 1)
            shard(rank)
        """)
    err = info.value
    assert err.rank == 1 and list(err.errors) == [1] and err.values == {0: -10}, (
        "rank 0's value still comes back"
    )
    assert str(err).startswith("rank 1 raised ZeroDivisionError: integer division or modulo by zero")
    assert "Meanwhile rank 0 returned -10 (err.values). The group still runs." in str(err)
    shown = capsys.readouterr().err.splitlines()
    assert '[rank 1]   File "<ranks cell 1>", line 4, in <module>' in shown, shown
    assert (
        "[rank 1]     return 10 // (r - 1)" in shown
        and "[rank 1] ZeroDivisionError: integer division or modulo by zero" in shown
    )
    assert not any(line.startswith("[rank 0]") for line in shown), shown
    with pytest.raises(CellError, match=r"rank 0 its value, a bytes, pickles to more than 100 bytes"):
        ranks("b'x' * (1000 * (1 - rank))", "--max-bytes 100")
    with pytest.raises(CellError, match="cannot be rebuilt in the kernel") as info:
        ranks("class Point:\n    pass\nPoint()")
    assert "a class or function defined in a %%ranks cell exists only on the ranks" in info.value.errors[0]
    with pytest.raises(SyntaxError):
        ranks("x = (")
    assert ranks("rank + 1") == {0: 1, 1: 2}, "the group still runs"


def test_bad_input_says_what_to_do(shell, ranks):
    from IPython.core.error import UsageError

    with pytest.raises(
        ValueError, match=r"name at least one of this group's ranks, 0..1 \(\[5\] is not one\)"
    ):
        ranks("1", "--ranks 0,5")
    with pytest.raises(UsageError, match="--ranks takes ranks separated by commas"):
        ranks("1", "--ranks one")
    with pytest.raises(ValueError, match="max_bytes must be a whole number of bytes from 1 to 8,388,608"):
        ranks("1", "--max-bytes 0")
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        ranks("1", "--timeout -1")
    with pytest.raises(UsageError, match="%ranks start -n 2 starts 2 ranks"):
        shell.run_line_magic("ranks", "begin")
    assert ranks("rank") == {0: 0, 1: 1}
    shell.run_line_magic("ranks", "stop")
    with pytest.raises(UsageError, match="no ranks are running: start them with %ranks start -n 2 first"):
        ranks("1")
    shell.run_line_magic("ranks", "start -n 2")  # for the fixture to stop


def test_lines_arrive_complete_and_in_order(ranks, capsys):
    n = 50_000
    ranks(f"""
        import sys
        sys.stdout.write("".join(f"{{rank}} {{i}}\\n" for i in range({n})))
        print("e", rank, file=sys.stderr)
        print("no newline", end="")
    """)
    out, err = capsys.readouterr()  # the cell has returned: every line of it has been shown
    for rank in (0, 1):
        mine = [line for line in out.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert mine == [f"[rank {rank}] {rank} {i}" for i in range(n)] + [f"[rank {rank}] no newline"]
        assert f"[rank {rank}] e {rank}" in err.splitlines()
    ranks("print('next cell')")
    assert sorted(capsys.readouterr().out.splitlines()) == ["[rank 0] next cell", "[rank 1] next cell"]


def test_a_collective_on_only_one_rank_is_named_as_a_hang_and_nothing_is_left(shell, ranks, capsys):
    ranks("x = torch.ones(1)")
    pid = shell.magics_manager.registry["RankMagics"].group.conns[0].pid

    # A cell's stall counts from the cell's start; here the 2 s count from the moment rank 0 waits inside
    # all_reduce, so that however long a busy machine takes to get it there, the dump finds it in the call.
    def in_the_call() -> bool:
        return in_native_call(pid, "c10d::Work::wait", "all_reduce", at=("<ranks cell 2>", 2))

    with clocks_start_when(in_the_call), pytest.raises(JobHungError) as info:
        ranks("print('reducing', flush=True)\ndist.all_reduce(x)", "--ranks 0 --stall-timeout 2")
    err = info.value
    assert err.hang == Hang("stall", 2, cell=True) and err.stuck_ranks == [1], str(err)
    message = str(err)
    assert "rank 1 does not run this cell (--ranks left it out)" in message
    assert "rank 0 waits in torch.distributed `all_reduce` called at <ranks cell 2>:2" in message
    assert message.endswith("The group is gone: %ranks start -n 2 starts a new one."), message
    assert "<ranks cell 2>" in err.stacks[0] and "print(err.stacks[0])" in message
    assert "[rank 0] reducing" in capsys.readouterr().out
    assert wait_for_no_leftovers(os.getpid(), within=60) == []
    shell.run_line_magic("ranks", "start -n 2")  # for the fixture to stop


def test_a_rank_that_dies_ends_the_group_with_the_launchers_diagnosis(shell, ranks):
    with pytest.raises(JobFailedError) as info:
        ranks("import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\nrank")
    err = info.value
    assert err.rank == 1 and err.exitcode == -signal.SIGKILL, str(err)
    assert str(err).startswith("rank 1 was killed by SIGKILL (exit code -9)"), str(err)
    assert str(err).endswith("The group is gone: %ranks start -n 2 starts a new one.")
    assert wait_for_no_leftovers(os.getpid(), within=60) == []
    shell.run_line_magic("ranks", "start -n 2")


def test_an_interrupt_stops_the_cell_and_keeps_the_group(interrupt_when, ranks, tmp_path, capsys):
    # Each rank makes its file inside the cell, where an interrupt stops it, and sleeps on the same line, so
    # that the traceback's line is the same whether the interrupt finds it before or in time.sleep.
    interrupt_when(lambda: (tmp_path / "in0").exists() and (tmp_path / "in1").exists())
    with pytest.raises(KeyboardInterrupt):
        ranks(f"import time\nopen(f'{tmp_path}/in{{rank}}', 'w').close(); time.sleep(600)")
    err = capsys.readouterr().err
    assert "ddp_helpers: interrupted; rank(s) 0, 1 stopped the cell; the group still runs" in err, err
    assert '[rank 1]   File "<ranks cell 1>", line 2, in <module>' in err.splitlines(), err
    assert ranks("rank") == {0: 0, 1: 1}, "the group still runs"


def test_an_interrupt_a_rank_in_a_collective_cannot_answer_is_a_hang(interrupt_when, shell, ranks, tmp_path):
    pids = {r: c.pid for r, c in shell.magics_manager.registry["RankMagics"].group.conns.items()}

    def both_in_place() -> bool:
        """Rank 0 is inside the barrier's C++ wait, where SIGINT cannot reach Python, and rank 1 has replied:
        it made its file in the cell, and now waits for the next message (it sent its reply before that)."""
        return (
            (tmp_path / "done1").exists()
            and in_python_call(pids[1], "MessageReader.next", "_protocol.py")
            and in_native_call(pids[0], "c10d::Work::wait", "barrier")
        )

    interrupt_when(both_in_place)
    with pytest.raises(JobHungError) as info:
        cell = f"if rank == 0:\n    dist.barrier()\nelse:\n    open('{tmp_path}/done1', 'w').close()\nrank"
        ranks(cell, "--timeout 300")  # a safety net: the interrupt comes long before
    err = info.value
    assert err.hang == Hang("interrupt", launcher.TERM_GRACE, cell=True) and err.stuck_ranks == [1], str(err)
    assert "rank 0 waits in torch.distributed `barrier` called at <ranks cell 1>:2" in str(err)
    assert "rank 1 had finished the cell and waits for the next one" in str(err)
    assert wait_for_no_leftovers(os.getpid(), within=60) == []
    shell.run_line_magic("ranks", "start -n 2")


# ---- a real Jupyter kernel: its Interrupt, and its death by SIGKILL ---------------------------------------


def _execute(kc, code: str, until: tuple[str, ...] = (), then=None) -> tuple[str, list[dict], dict | None]:
    """Run ``code`` in the kernel: its stream text, its error contents and its result; ``then()`` runs once
    every string of ``until`` has appeared in the stream text."""
    msg_id = kc.execute(code)
    text, errors, value = "", [], None
    while True:
        msg = kc.get_iopub_msg(timeout=300)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream":
            text += msg["content"]["text"]
            if until and all(u in text for u in until):
                then()
                until = ()
        elif kind == "error":
            errors.append(msg["content"])
        elif kind == "execute_result":
            value = msg["content"]["data"]
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            return text, errors, value


def test_in_a_real_kernel_interrupt_keeps_the_group_and_sigkill_leaves_nothing(tmp_path):
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        pid = km.provisioner.pid
        text, errors, _ = _execute(kc, "%load_ext ddp_helpers\n%ranks start -n 2")
        assert "2 rank(s) ready" in text and not errors, (text, errors)
        # Interrupt once both ranks run the cell (a rank not yet in it ignores the interrupt, then sleeps).
        sleep = "%%ranks\nimport time\nprint('sleeping', flush=True); time.sleep(600)"
        in_cell = ("[rank 0] sleeping", "[rank 1] sleeping")
        text, errors, _ = _execute(kc, sleep, until=in_cell, then=km.interrupt_kernel)
        assert [e["ename"] for e in errors] == ["KeyboardInterrupt"], (text, errors)
        assert "rank(s) 0, 1 stopped the cell; the group still runs" in text, text
        _, errors, value = _execute(kc, "%%ranks\nrank * 2")
        assert not errors and value["text/plain"] == "{0: 0, 1: 2}", (errors, value)
        text, _, _ = _execute(kc, "%%ranks\nimport os\nprint(os.environ['DDP_HELPERS_RUN_DIR'])")
        # the ranks' lines arrive in any order: take rank 0's
        run_dir = next(line for line in text.splitlines() if line.startswith("[rank 0] "))
        run_dir = run_dir.removeprefix("[rank 0] ")
        assert os.path.isdir(run_dir)
        km.provisioner.process.kill()  # SIGKILL: nothing of the kernel runs to clean up
        km.provisioner.process.wait()
        assert wait_for_no_leftovers(pid, within=60) == []
        for _ in range(600):  # agent 0 removes the run folder as its lifeline ends, then the ranks die
            if not os.path.exists(run_dir):
                break
            time.sleep(0.1)
        assert not os.path.exists(run_dir), "the run folder outlived its kernel"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_stop_lets_every_rank_leave_cleanly_with_a_ddp_wrapper_alive(kernel_unchanged):
    """A cell's DDP wrapper goes before the process group does, so every rank exits with code 0."""
    from ddp_helpers import RankGroup

    with RankGroup(2) as group:
        group.run(
            "from torch.nn.parallel import DistributedDataParallel as DDP\nddp = DDP(torch.nn.Linear(2, 2))"
        )
    assert group.closed and group.launch.agents.returncode() == 0, group.launch.agents.returncode()
    evidence = {r.rank: r.evidence(agents_ok=True) for r in group.launch.ranks}
    assert all(e.script_exit == 0 for e in evidence.values()), evidence
