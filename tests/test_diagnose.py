"""Pure-function tests of the hang and failure diagnosis (no processes started)."""

from ddp_helpers import diagnose

DUMP = """Thread 0x00007f0000000001 (most recent call first):
  File "/site/ddp_helpers/_worker.py", line 42 in _die_with_parent
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


def test_parse_stack_dump_splits_threads_innermost_first():
    threads = diagnose.parse_stack_dump(DUMP.format(collective="all_reduce", line=17))
    assert len(threads) == 2
    assert threads[1][0].func == "all_reduce" and threads[1][2].line == 17


def test_rank_state_waiting_busy_exited():
    waiting = diagnose.rank_state(0, DUMP.format(collective="barrier", line=12), "/work/train.py", True, None)
    assert waiting.collective == "barrier" and waiting.script_frame.line == 12
    assert "waits in torch.distributed `barrier` called at train.py:12" in waiting.describe()
    busy = diagnose.rank_state(1, BUSY, "/work/train.py", True, None)
    assert busy.collective is None and "busy at train.py:15 in main" in busy.describe()
    gone = diagnose.rank_state(2, None, "/work/train.py", False, 0)
    assert "had already exited (exit code 0)" in gone.describe()


BACKWARD = """Current thread 0x00007f0000000002 (most recent call first):
  File "/site/torch/autograd/graph.py", line 841 in _engine_run_backward
  File "/site/torch/autograd/__init__.py", line 354 in backward
  File "/site/torch/_tensor.py", line 625 in backward
  File "/work/train.py", line 21 in step
"""


def test_a_rank_blocked_in_backward_waits_for_ddp():
    state = diagnose.rank_state(0, BACKWARD, "/work/train.py", True, None)
    assert state.collective == diagnose.BACKWARD
    other = diagnose.rank_state(1, DUMP.format(collective="all_gather", line=30), "/work/train.py", True, None)
    stuck, why = diagnose.culprits([state, other])
    assert [s.rank for s in stuck] == [0, 1] and "different collectives" in why


def test_a_rank_hanging_after_its_script_ended_is_a_culprit():
    shutting = diagnose.rank_state(1, BUSY, "/work/train.py", True, 1)
    assert "finished its script (exit code 1) but its process hangs" in shutting.describe()
    wait = diagnose.rank_state(0, DUMP.format(collective="barrier", line=12), "/work/train.py", True, None)
    assert diagnose.culprits([wait, shutting])[0] == [shutting]


def test_culprits():
    wait = diagnose.rank_state(0, DUMP.format(collective="barrier", line=12), "/work/train.py", True, None)
    busy = diagnose.rank_state(1, BUSY, "/work/train.py", True, None)
    gone = diagnose.rank_state(2, None, "/work/train.py", False, 0)
    assert [s.rank for s in diagnose.culprits([wait, busy])[0]] == [1]
    assert [s.rank for s in diagnose.culprits([wait, gone])[0]] == [2]
    other = diagnose.rank_state(1, DUMP.format(collective="all_reduce", line=17), "/work/train.py", True, None)
    stuck, why = diagnose.culprits([wait, other])
    assert [s.rank for s in stuck] == [0, 1] and "different collectives" in why
    same = diagnose.rank_state(1, DUMP.format(collective="barrier", line=12), "/work/train.py", True, None)
    assert "same collective" in diagnose.culprits([wait, same])[1]
    silent = diagnose.rank_state(1, None, "/work/train.py", True, None)
    assert diagnose.culprits([wait, silent])[0] == [silent]


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
