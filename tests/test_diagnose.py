"""Pure-function tests of whom to blame, and of when a job counts as hung: made-up evidence, no processes.

These carry the wording of every failure and hang message; the end-to-end tests in test_launcher.py check that
real jobs produce the evidence (status events, torch's failure records, stack dumps) these functions read.
"""

import math
import signal

from ddp_helpers import diagnose
from ddp_helpers.outcome import Hang, JobFailedError, JobHungError, TorchrunError, TorchrunResult

SCRIPT = "/work/train.py"
DUMP = """Thread 0x00007f0000000001 (most recent call first):
  File "/site/ddp_helpers/_protocol.py", line 42 in _die_with_parent
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f0000000002 (most recent call first):
  File "/site/torch/distributed/distributed_c10d.py", line 3913 in {collective}
  File "/site/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/work/train.py", line {line} in main
  File "/work/train.py", line 30 in <module>
  File "/site/ddp_helpers/_worker.py", line 92 in main
"""

BUSY = """Current thread 0x00007f0000000002 (most recent call first):
  File "/work/train.py", line 15 in main
  File "/work/train.py", line 30 in <module>
"""

BACKWARD = """Current thread 0x00007f0000000002 (most recent call first):
  File "/site/torch/autograd/graph.py", line 841 in _engine_run_backward
  File "/site/torch/autograd/__init__.py", line 354 in backward
  File "/site/torch/_tensor.py", line 625 in backward
  File "/work/train.py", line 21 in step
"""


def hung(
    rank: int,
    stack: str | None = None,
    *,
    alive: bool = True,
    started: bool = True,
    script_exit: int | None = None,
) -> diagnose.RankEvidence:
    """A rank's record as the launcher makes it when a job hangs."""
    return diagnose.RankEvidence(rank, started=started, alive=alive, stack=stack, script_exit=script_exit)


def waiting(rank: int, collective: str = "barrier", line: int = 12) -> diagnose.RankEvidence:
    return hung(rank, DUMP.format(collective=collective, line=line))


def result(world_size: int = 2, stderr: dict | None = None, returncode: int = 1) -> TorchrunResult:
    lines = {r: [] for r in range(world_size)}
    return TorchrunResult(
        "torchrun x.py",
        returncode,
        1.0,
        dict(lines),
        {**lines, **(stderr or {})},
        dict.fromkeys(lines),
        ["torchrun: its last line"],
    )


def test_parse_stack_dump_splits_threads_innermost_first():
    threads = diagnose.parse_stack_dump(DUMP.format(collective="all_reduce", line=17))
    assert len(threads) == 2
    assert threads[1][0].func == "all_reduce" and threads[1][2].line == 17


def test_where_a_hung_rank_was():
    assert "waits in torch.distributed `barrier` called at train.py:12" in diagnose.describe_hung(
        waiting(0), SCRIPT
    )
    assert diagnose.place(DUMP.format(collective="barrier", line=12), SCRIPT).script_frame.line == 12
    assert "rank 1 is busy at train.py:15 in main" in diagnose.describe_hung(hung(1, BUSY), SCRIPT)
    gone = hung(2, alive=False, script_exit=0)
    assert "rank 2 had already exited (exit code 0) while its peers waited" in diagnose.describe_hung(
        gone, SCRIPT
    )
    assert "(exit code unknown)" in diagnose.describe_hung(hung(2, alive=False), SCRIPT)
    assert "never started its script" in diagnose.describe_hung(hung(3, alive=False, started=False), SCRIPT)
    assert "no stack dump arrived" in diagnose.describe_hung(hung(4), SCRIPT)


def test_a_rank_blocked_in_backward_waits_for_ddp():
    state = hung(0, BACKWARD)
    assert diagnose.place(BACKWARD, SCRIPT).collective == diagnose.BACKWARD
    stuck, why = diagnose.culprits([state, waiting(1, "all_gather", 30)], SCRIPT)
    assert [r.rank for r in stuck] == [0, 1] and "different collectives" in why


def test_a_rank_hanging_after_its_script_ended_is_a_culprit():
    shutting = hung(1, BUSY, script_exit=1)
    assert "finished its script (exit code 1) but its process hangs" in diagnose.describe_hung(
        shutting, SCRIPT
    )
    assert diagnose.culprits([waiting(0), shutting], SCRIPT)[0] == [shutting]


def test_culprits():
    wait, busy, gone = waiting(0), hung(1, BUSY), hung(2, alive=False, script_exit=0)
    assert [r.rank for r in diagnose.culprits([wait, busy], SCRIPT)[0]] == [1]
    assert [r.rank for r in diagnose.culprits([wait, gone], SCRIPT)[0]] == [2]
    stuck, why = diagnose.culprits([wait, waiting(1, "all_reduce", 17)], SCRIPT)
    assert [r.rank for r in stuck] == [0, 1] and "different collectives" in why
    assert "same collective" in diagnose.culprits([wait, waiting(1)], SCRIPT)[1]
    silent = hung(1)
    assert diagnose.culprits([wait, silent], SCRIPT)[0] == [silent]


def test_the_hang_message_names_the_culprit_first_then_who_waits():
    """What test_launcher's hang tests used to read off real jobs: the wording, for a timeout and a stall."""
    records = [waiting(0, "all_reduce", 9), hung(1, BUSY)]
    err = diagnose.hang_error(result(), Hang("timeout", 12), records, SCRIPT)
    assert isinstance(err, JobHungError) and isinstance(err, TorchrunError) and isinstance(err, RuntimeError)
    lines = str(err).splitlines()
    assert (
        lines[0] == "timed out after 12 s; stuck: rank 1 (the stuck rank(s) never reached the collective "
        "their peers wait in)."
    ), lines
    assert lines[1].startswith("  rank 1 is busy at train.py:15 in main") and lines[2] == "Waiting for them:"
    assert lines[3] == "  rank 0 waits in torch.distributed `all_reduce` called at train.py:9 in main", lines
    assert lines[-1] == (
        "Every rank was killed. The stack dumps are on the error: print(err.stacks[1]); "
        "the logs on err.result."
    ), "the culprit's dump is the one to read first"
    assert err.stuck_ranks == [1] and err.hang == Hang("timeout", 12) and err.timed_out and err.hung
    assert err.stacks == {0: records[0].stack, 1: BUSY} and err.rank is None and err.exitcode is None
    stall = diagnose.hang_error(result(), Hang("stall", 2), records, SCRIPT)
    assert str(stall).startswith(
        "stalled: every rank had printed, then none printed anything for 2 s; stuck: rank 1"
    )
    assert stall.hang.kind == "stall" and stall.hang.seconds == 2 and stall.hung and not stall.timed_out
    gone = diagnose.hang_error(result(), Hang("timeout", 5), [waiting(0), hung(1, "", alive=True)], SCRIPT)
    assert gone.stacks == {0: waiting(0).stack, 1: ""}, (
        "a live rank that sent nothing still has its (empty) entry"
    )
    assert str(gone).endswith("on the error: print(err.stacks[0]); the logs on err.result."), (
        "the hint shows a dump that has lines"
    )
    none = diagnose.hang_error(result(), Hang("timeout", 5), [hung(0, "", alive=True)], SCRIPT)
    assert str(none).endswith(
        "Every rank was killed. The stack dumps are on the error; the logs on err.result."
    )


def test_a_record_merges_torchs_failure_record_with_the_status_file():
    start = {"event": "start", "pid": 10, "pgid": 10, "time": 1.0}
    raised = {"event": "exception", "type": "ValueError", "time": 2.5}
    ended = {"event": "exit", "code": 1, "time": 2.6}
    record = diagnose.rank_evidence(1, [start, raised, ended], {"exitcode": 1, "timestamp": 2})
    assert (record.exitcode, record.raised, record.time, record.script_exit) == (1, "ValueError", 2.5, 1)
    assert record.failed and not record.stopped_by_torchrun
    killed = diagnose.rank_evidence(1, [start], {"exitcode": -9, "timestamp": 7})  # SIGKILL: no exit event
    assert (killed.exitcode, killed.time, killed.script_exit) == (-9, 7, None) and killed.started
    stopped = diagnose.rank_evidence(0, [start], None, agents_ok=False)
    assert stopped.exitcode is None and not stopped.failed and stopped.time == math.inf
    assert diagnose.rank_evidence(0, [start], None, agents_ok=True).exitcode == 0
    restarted = diagnose.rank_evidence(
        1, [start, raised, ended, {**start, "pid": 11}, {"event": "exit", "code": 0}]
    )
    assert restarted.raised is None and restarted.exitcode == 0, "only the last attempt counts"
    assert not diagnose.rank_evidence(2, []).started


def _failed(rank: int, exitcode: int, raised: str | None = None, time: float = 1.0) -> diagnose.RankEvidence:
    return diagnose.RankEvidence(rank, started=True, exitcode=exitcode, raised=raised, time=time)


TRACEBACK = [
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:   File "/work/train.py", line 7, in load_batch',
    '[rank1]:     raise ValueError("bad batch on purpose")',
    "[rank1]: ValueError: bad batch on purpose",
]


def test_the_failure_message_names_the_first_failing_rank_and_its_traceback():
    records = {0: _failed(0, -signal.SIGTERM, time=3.0), 1: _failed(1, 1, "ValueError", time=2.0)}
    err = diagnose.failure_error(result(stderr={1: ["noise", *TRACEBACK]}), records)
    assert isinstance(err, JobFailedError) and isinstance(err, TorchrunError) and not err.hung
    assert (
        err.rank == 1
        and err.exitcode == 1
        and err.hang is None
        and err.stuck_ranks == []
        and err.stacks == {}
    )
    lines = str(err).splitlines()
    assert lines[0] == (
        "rank 1 raised ValueError (exit code 1); then 1 other rank(s) stopped too: rank 0 was "
        "killed by SIGTERM (exit code -15)."
    ), lines
    assert lines[1:] == [
        "--- rank 1 stderr (last traceback) ---",
        "Traceback (most recent call last):",
        '  File "/work/train.py", line 7, in load_batch',
        '    raise ValueError("bad batch on purpose")',
        "ValueError: bad batch on purpose",
    ], lines


def test_whom_a_failure_blames():
    # A rank torchrun stopped (SIGTERM, no exception) is blamed last, however early it died.
    stopped, raised = _failed(0, -signal.SIGTERM, time=1.0), _failed(1, 1, "RuntimeError", time=5.0)
    assert sorted([stopped, raised], key=diagnose.blame_order) == [raised, stopped]
    early, late = _failed(1, 1, "ValueError", time=1.0), _failed(0, 1, "ValueError", time=2.0)
    assert sorted([late, early], key=diagnose.blame_order) == [early, late]
    killed = diagnose.failure_error(
        result(), {0: _failed(0, -signal.SIGTERM), 1: _failed(1, -signal.SIGKILL, time=0)}
    )
    assert str(killed).startswith("rank 1 was killed by SIGKILL (exit code -9)") and killed.exitcode == -9
    code = diagnose.failure_error(result(), {0: _failed(0, 4), 1: diagnose.RankEvidence(1, exitcode=0)})
    assert str(code).startswith(
        "rank 0 exited with code 4.\nNote: rank 1 exited normally (code 0) while the "
        "others were still running"
    ), str(code)
    assert "(rank wrote nothing to stderr)" in str(code)
    dying = diagnose.failure_error(result(), {0: _failed(0, -signal.SIGABRT, "RuntimeError")})
    assert str(dying).startswith(
        "rank 0 raised RuntimeError, then was killed by SIGABRT (exit code -6) while shutting down"
    ), str(dying)
    itself = diagnose.failure_error(
        result(returncode=1), {0: diagnose.RankEvidence(0), 1: diagnose.RankEvidence(1)}
    )
    assert str(itself).startswith(
        "torchrun itself failed (exit code 1) before any rank reported an error. Its "
        "last lines:\ntorchrun: its last line"
    ), str(itself)
    assert itself.rank is None


def test_a_long_traceback_is_cut_to_about_twenty_lines():
    """Replaces the end-to-end test of the same name: the cut is this function's alone."""
    frames = [
        line
        for i in range(31)
        for line in (f'  File "/work/deep.py", line {i + 2}, in f{i}', f"    f{i + 1}()")
    ]
    lines = ["Traceback (most recent call last):", *frames, "RuntimeError: deep"]
    cut = diagnose.last_traceback(lines)
    assert len(cut) == 20 and cut[0] == lines[0] and cut[-1] == "RuntimeError: deep" and "in f30" in cut[-3]
    assert cut[1] == f"  ... ({len(lines) - 19} lines cut; the whole log is on the error's .result)", cut[1]
    err = diagnose.failure_error(result(1, {0: lines}), {0: _failed(0, 1, "RuntimeError")})
    assert "lines cut" in str(err) and len(str(err).splitlines()) <= 25


def test_last_traceback_strips_torch_prefix_and_launcher_frames():
    lines = [
        "some log line",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "<frozen runpy>", line 88, in _run_code',
        '[rank1]:   File "/site/ddp_helpers/_worker.py", line 92, in main',
        "[rank1]:     runpy.run_path(script)",
        '[rank1]:   File "/work/train.py", line 7, in step',
        '[rank1]:     raise ValueError("x")',
        "[rank1]: ValueError: x",
        "a later unrelated line",
    ]
    assert diagnose.last_traceback(lines) == [
        "Traceback (most recent call last):",
        '  File "/work/train.py", line 7, in step',
        '    raise ValueError("x")',
        "ValueError: x",
    ]
    assert diagnose.last_traceback(["only", "lines"]) == ["only", "lines"]


def test_signal_name():
    assert diagnose.signal_name(-9) == "SIGKILL"
    assert diagnose.signal_name(1) is None and diagnose.signal_name(None) is None


def test_a_stall_counts_from_the_ranks_output_not_from_the_launch():
    """Replaces the end-to-end stall test (8-9 s of sleeping): the same story, told by a fake clock."""
    watch = diagnose.Watch(start=100.0, timeout=300, stall_timeout=2)
    assert watch.check(104.0, new_lines=False, every_rank_printed=False) is None  # silent 4 s before any line
    assert watch.check(104.1, new_lines=True, every_rank_printed=False) is None  # rank 0's first line
    assert watch.check(107.0, new_lines=False, every_rank_printed=False) is None  # rank 1 has not printed yet
    for tick in range(10):  # both ranks print every 0.2 s for 2 s
        assert watch.check(107.2 + 0.2 * tick, new_lines=True, every_rank_printed=True) is None
    assert watch.check(110.8, new_lines=False, every_rank_printed=True) is None  # 1.8 s of silence
    assert watch.check(111.1, new_lines=False, every_rank_printed=True) == Hang("stall", 2)  # 2.1 s: a stall


def test_a_timeout_counts_from_the_launch_whatever_the_ranks_print():
    watch = diagnose.Watch(start=0.0, timeout=12, stall_timeout=None)
    assert watch.check(11.9, new_lines=True, every_rank_printed=True) is None
    assert watch.check(12.1, new_lines=True, every_rank_printed=True) == Hang("timeout", 12)
    assert str(Hang("timeout", 12)) == "timed out after 12 s"
    assert diagnose.Watch(0.0, None, None).check(1e9, False, True) is None  # no limit, no hang


def test_last_traceback_folds_torchs_inner_frames_and_keeps_where_it_raised():
    torch_frame = '  File "/venv/lib/python3.11/site-packages/torch/{0}.py", line {1}, in {0}'
    lines = [
        "Traceback (most recent call last):",
        '  File "/work/train.py", line 30, in main',
        "    loss.backward()",
        torch_frame.format("_tensor", 625),
        "    torch.autograd.backward(",
        torch_frame.format("autograd", 354),
        "    _engine_run_backward(",
        "    ^^^^^^^^^^^^^^^^^^^^^",
        torch_frame.format("graph", 841),
        "    return Variable._execution_engine.run_backward(",
        "RuntimeError: Expected to mark a variable ready only once.",
    ]
    assert diagnose.last_traceback(lines) == [
        "Traceback (most recent call last):",
        '  File "/work/train.py", line 30, in main',
        "    loss.backward()",
        "  ... (2 frames inside torch)",
        torch_frame.format("graph", 841),
        "    return Variable._execution_engine.run_backward(",
        "RuntimeError: Expected to mark a variable ready only once.",
    ]
    one = lines[:3] + lines[5:8] + lines[10:]
    assert diagnose.last_traceback(one) == one  # a torch frame that is the innermost is kept
    middle = lines[:5] + ['  File "/work/model.py", line 4, in forward', "    x.relu_()"] + lines[-1:]
    assert "  ... (1 frame inside torch)" in diagnose.last_traceback(middle)


# ---- a %%ranks cell's hang (ddp_helpers.ranks): ranks that are not running the cell -----------------------

CELL = "<ranks cell 3>"
CELL_DUMP = """Current thread 0x00007f0000000002 (most recent call first):
  File "/site/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "/site/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "<ranks cell 3>", line 2 in <module>
  File "/site/ddp_helpers/_repl.py", line 150 in run_cell
"""
CELL_BUSY = """Current thread 0x00007f0000000002 (most recent call first):
  File "<ranks cell 3>", line 4 in <module>
  File "/site/ddp_helpers/_repl.py", line 150 in run_cell
"""
IDLE_DUMP = """Current thread 0x00007f0000000002 (most recent call first):
  File "/site/ddp_helpers/_protocol.py", line 140 in receive
  File "/site/ddp_helpers/_repl.py", line 198 in serve
"""


def idle(rank: int, why: str = "finished") -> diagnose.RankEvidence:
    return diagnose.RankEvidence(rank, started=True, alive=True, stack=IDLE_DUMP, idle=why)


def test_a_rank_not_running_the_cell_is_blamed_only_when_a_peer_waits_in_a_collective():
    waits = hung(0, CELL_DUMP)
    stuck, why = diagnose.culprits([waits, idle(1, "left out")], CELL)
    assert [r.rank for r in stuck] == [1] and "never reached the collective" in why
    assert (
        diagnose.describe_hung(idle(1, "left out"), CELL)
        == "rank 1 does not run this cell (--ranks left it out)"
    )
    assert diagnose.describe_hung(idle(1), CELL) == "rank 1 had finished the cell and waits for the next one"
    assert diagnose.describe_hung(waits, CELL) == (
        "rank 0 waits in torch.distributed `all_reduce` called at <ranks cell 3>:2 in <module>"
    )
    busy = hung(0, CELL_BUSY)  # a rank busy in the cell (say, sleeping): the finished one is no culprit
    assert diagnose.culprits([busy, idle(1)], CELL)[0] == [busy]
    assert diagnose.culprits([hung(0), idle(1)], CELL)[0] == [hung(0)], "a silent rank, not the idle one"


def test_a_cell_hang_message_points_at_a_dump_of_the_cell_and_ends_with_the_note():
    records = [hung(0, CELL_DUMP), idle(1)]
    err = diagnose.hang_error(result(), Hang("stall", 2, cell=True), records, CELL, note="Start again.")
    lines = str(err).splitlines()
    assert lines[0] == (
        "stalled: no rank printed a line or finished the cell for 2 s; stuck: rank 1 (the stuck rank(s) "
        "never reached the collective their peers wait in)."
    ), lines
    assert "print(err.stacks[0])" in lines[-2], "rank 0's dump shows the cell; rank 1's only the REPL"
    assert lines[-1] == "Start again." and err.stuck_ranks == [1] and err.hang.kind == "stall"


def test_the_cell_hang_kinds():
    assert str(Hang("interrupt", 3, cell=True)) == (
        "interrupted, and not every rank had stopped the cell 3 s later"
    )
    assert Hang("interrupt", 3).kind == "interrupt" and Hang("stall", 2) != Hang("stall", 2, cell=True)
    watch = diagnose.Watch(start=0.0, timeout=None, stall_timeout=2, cell=True)
    assert watch.check(1.5, new_lines=True, every_rank_printed=True) is None  # a reply counts as a line
    assert watch.check(3.6, new_lines=False, every_rank_printed=True) == Hang("stall", 2, cell=True)
    failed = diagnose.failure_error(result(), {0: diagnose.RankEvidence(0, exitcode=-9)}, note="Start again.")
    assert str(failed).splitlines()[-1] == "Start again." and failed.rank == 0


def test_ranks_that_all_send_first_are_told_why_they_wait():
    stuck, why = diagnose.culprits([waiting(0, "send", 14), waiting(1, "send", 14)], SCRIPT)
    assert [r.rank for r in stuck] == [0, 1] and why.startswith(
        "every rank waits in `send`, which returns"
    ), why
    assert "use isend and irecv" in why, why
    assert "waits in `recv`" in diagnose.culprits([waiting(0, "recv"), waiting(1, "recv")], SCRIPT)[1]
