"""tools/torch_matrix.py without installing anything (pairing, comparing outcomes, notebook verdicts, the
table, the markers), and MEASURES.md's table kept in step with the floor pyproject.toml declares."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ddp_test_support import REPO

_spec = importlib.util.spec_from_file_location("torch_matrix", REPO / "tools" / "torch_matrix.py")
tm = importlib.util.module_from_spec(_spec)
sys.modules["torch_matrix"] = tm
_spec.loader.exec_module(tm)

PINNED = {"torch": "2.14.1", "torchvision": "0.29.1"}
OK = {"failed": False, "records": [{"rank": 0, "loss": 0.5}], "exitcodes": {"0": 0}}


def _case(cold, warm=None):
    return {"cold": cold, "warm": cold if warm is None else warm, "seconds": {}}


def test_versions_and_the_floor():
    assert tm.minor_of("2.13.0+cpu") == (2, 13) and tm.label((2, 4)) == "2.4"
    newest = tm.newest_minor(["2.15.0", "2.16.0+cpu", "2.14.1"])
    assert newest == (2, 15), newest  # a local build alone does not count
    assert tm.release("2.13.0+cpu") == (2, 13, 0) and tm.release("2.15.0") > tm.release("2.9.1")
    assert tm.pinned_pair() == PINNED


def test_the_floor_is_one_number_everywhere():
    """pyproject.toml declares it; notebook 00 refuses anything older; the doctor and this tool read it (and
    the pins) with one parser, ddp_helpers.pins."""
    floor = tm.declared_floor()
    assert floor == (2, 8), floor
    nb = json.loads((REPO / "notebooks" / "00_start_here.ipynb").read_text())
    first = "".join(next(c for c in nb["cells"] if "torch_version >=" in "".join(c["source"]))["source"])
    assert f"torch_version >= {floor}" in first, first
    assert f"needs torch {tm.label(floor)} or newer" in first, first
    from ddp_helpers import doctor, pins

    assert tm.read_floors is pins.read_floors is doctor.read_floors
    assert tm.read_pins is pins.read_pins is doctor.read_pins and tm.release is pins.release is doctor.release


def test_differences_separate_float_rounding_from_behaviour():
    assert tm.differences({"a": [1.0, 2], "ok": True}, {"a": [1.0, 2], "ok": True}) == ([], 0.0)
    paths, worst = tm.differences({"a": [1.0, 2]}, {"a": [1.00001, 2]})
    assert paths == [] and 0 < worst < tm.FLOAT_RTOL
    assert tm.differences({"a": [1.0, 3], "b": 1}, {"a": [1.1, 2], "c": 1})[0] == ["a[0]", "a[1]", "b", "c"]
    assert tm.differences({"x": True}, {"x": 1})[0] == ["x"]  # a bool is not the number 1 here
    assert tm.differences([1, 2], [1])[0] == ["value (length 2 vs 1)"]


def test_script_verdicts():
    assert tm.script_verdict("00_hello", _case(OK), _case(OK), (2, 6)) == ("pass", "")
    close = dict(OK, records=[{"rank": 0, "loss": 0.500001}])
    assert tm.script_verdict("00_hello", _case(close), _case(OK), (2, 6))[0] == "pass≈"
    drift = dict(OK, records=[{"rank": 0, "loss": 0.51}])
    verdict, detail = tm.script_verdict("00_hello", _case(drift), _case(OK), (2, 6))
    assert verdict == "floats differ" and "2.0e-02" in detail and "records[0].loss" in detail
    changed = dict(OK, records=[{"rank": 0, "loss": 0.5, "warned": True}])
    verdict, detail = tm.script_verdict("00_hello", _case(changed), _case(OK), (2, 6))
    assert verdict == "differs" and "records[0].warned" in detail
    crash = {
        "failed": True,
        "raised": ["AttributeError"],
        "hung": False,
        "stuck": [],
        "records": [],
        "error": "JobFailedError: rank 0 raised AttributeError (exit code 1).\n--- rank 0 stderr ---\n"
        "Traceback ...\nAttributeError: 'Stream' object has no attribute 'record_event'",
    }
    assert tm.script_verdict("08_memory", _case(crash), _case(OK), (2, 6)) == (
        "fails",
        "rank 0: AttributeError: 'Stream' object has no attribute 'record_event'",
    )
    hang = {
        "failed": True,
        "raised": [],
        "hung": True,
        "stuck": [0, 1],
        "records": [],
        "error": "JobHungError: timed out after 120 s; stuck: rank 0, rank 1 (waits).\n  rank 0 waits in x",
    }
    assert tm.script_verdict("05_launch", _case(hang), _case(OK), (2, 6)) == (
        "hangs",
        "timed out after 120 s; stuck: rank 0, rank 1 (waits).",
    )
    # 00_crash fails as it should
    assert tm.script_verdict("00_crash", _case(crash), _case(crash), (2, 6))[0] == "pass"
    assert tm.script_verdict("00_hello", _case(OK, warm=crash), _case(OK), (2, 6))[0] == "warm≠cold"
    assert tm.script_verdict("00_hello", _case(OK, warm=crash), None, (2, 14))[0] == "warm≠cold"  # pinned row
    assert tm.script_verdict("00_hello", {"cold": OK}, _case(OK), (2, 6))[0] == "not run"


def test_a_failed_launch_is_compared_by_its_distinct_records():
    """Which rank printed before torchrun stopped it is a race: a failed launch's records count as a set."""
    both = {
        "failed": True,
        "raised": ["ValueError"],
        "hung": False,
        "stuck": [],
        "records": [{"rank": 0, "arg": -1}, {"rank": 1, "arg": -1}],
    }
    one = dict(both, records=[{"rank": 1, "arg": -1}])
    assert tm.script_verdict("05_seed_snippet", _case(one, warm=both), _case(both), (2, 6)) == ("pass", "")


def test_named_differences_hold_only_where_named():
    (first, last) = next((a, b) for case, a, b, _, _ in tm.NAMED if case == "04_ddp")
    old = dict(OK, records=[{"rank": 0, "loss": 0.5, "broadcast_buffers=False": {"syncs": 1}}])
    new = dict(OK, records=[{"rank": 0, "loss": 0.5, "forward_sync_buffers=False": {"syncs": 1}}])
    verdict, detail = tm.script_verdict("04_ddp", _case(old), _case(new), first)
    assert verdict == "named" and re.fullmatch(r"\[N\d+\]", detail), (verdict, detail)
    assert tm.script_verdict("04_ddp", _case(old), _case(new), (last[0], last[1] + 1))[0] == "differs"
    other = dict(old, records=[{**old["records"][0], "loss": 0.7}])  # a named path does not excuse the others
    assert tm.script_verdict("04_ddp", _case(other), _case(new), first)[0] == "floats differ"
    assert tm.script_verdict("00_hello", _case(old), _case(new), first)[0] == "differs"


def test_the_ports_of_a_launch_are_not_compared():
    def launch(ports):
        return {"failed": False, "records": [{"rank": 0, "sum": 3.0, "tcp_opened": ports}]}

    assert tm.script_verdict(
        "05_launch", _case(launch([[1, 2]]), warm=launch([[3, 4], [5, 6]])), None, (2, 14)
    ) == ("pass", "")


def _nb(cells):
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def _code(outputs=(), replied=True, tags=()):
    meta = {"execution": {"shell.execute_reply": "t"} if replied else {}, "tags": list(tags)}
    return {"cell_type": "code", "source": "x", "outputs": list(outputs), "metadata": meta}


MD = {"cell_type": "markdown", "source": "# t", "metadata": {}}
FAILED, PASSED = {"rc": 1, "timed_out": False}, {"rc": 0, "timed_out": False}


def test_notebook_verdicts():
    error = {
        "output_type": "error",
        "ename": "AssertionError",
        "evalue": "first\n\x1b[31mthe last line\x1b[0m",
    }
    assert tm.notebook_verdict(FAILED, "", _nb([MD, _code(), MD, _code([error])])) == {
        "status": "fail",
        "cell": 3,
        "error": "AssertionError: the last line",
        "version_specific": False,
    }
    tagged = tm.notebook_verdict(FAILED, "", _nb([MD, _code([error], tags=[tm.VERSION_SPECIFIC])]))
    assert tagged["version_specific"] and tagged["cell"] == 1
    hang = {
        "output_type": "error",
        "ename": "JobHungError",
        "evalue": "timed out after 120 s; stuck: rank 0.\n"
        "  rank 0 waits in init_process_group\nEvery rank was killed.",
    }
    assert tm.notebook_verdict(FAILED, "", _nb([_code(), _code([hang])])) == {
        "status": "hang",
        "cell": 1,
        "error": "timed out after 120 s; stuck: rank 0.",
        "version_specific": False,
    }
    crash = {
        "output_type": "error",
        "ename": "JobFailedError",
        "evalue": "rank 1 raised AttributeError (exit "
        "code 1).\n--- rank 1 stderr (last traceback) ---\nTraceback\nAttributeError: no record_event",
    }
    assert (
        tm.notebook_verdict(FAILED, "", _nb([_code([crash])]))["error"]
        == "rank 1: AttributeError: no record_event"
    )
    log = "CellTimeoutError: A cell timed out while it was being executed, after 300 seconds"
    assert tm.notebook_verdict(FAILED, log, _nb([_code(), MD, _code(replied=False)])) == {
        "status": "hang",
        "cell": 2,
        "error": "no answer within 300 s",
    }
    assert tm.notebook_verdict({"rc": None, "timed_out": True}, "", None)["status"] == "hang"
    nbmake_1_5 = "A cell timed out while it was being executed, after 300 seconds."  # then KeyboardInterrupt
    assert tm.notebook_verdict({"rc": 1, "timed_out": False}, nbmake_1_5, None) == {
        "status": "hang",
        "cell": None,
        "error": "no answer within 300 s",
    }
    assert tm.notebook_verdict(PASSED, "", None) == {"status": "pass"}
    # version-specific cells run on (raises-exception): every one that failed is listed, and a later cell's
    # failure is still the verdict
    vs = tm.VERSION_SPECIFIC
    ran_on = _nb([_code([error], tags=[vs]), MD, _code(), _code([hang], tags=[vs])])
    assert tm.notebook_verdict(PASSED, "", ran_on) == {
        "status": "version-specific",
        "cell": 0,
        "error": "cell 0: AssertionError: the last line; cell 3: timed out after 120 s; stuck: rank 0.",
        "cells": [0, 3],
    }
    stopped = _nb([_code([error], tags=[vs]), _code([crash]), _code(replied=False)])
    assert tm.notebook_verdict(FAILED, "", stopped) == {
        "status": "fail",
        "cell": 1,
        "error": "rank 1: AttributeError: no record_event",
        "version_specific": False,
        "cells": [0],
    }


def test_version_specific_cells_are_let_fail_and_nothing_else_changes():
    nb = _nb([_code(tags=[tm.VERSION_SPECIFIC]), _code(tags=["other"]), MD])
    out = json.loads(tm.let_version_specific_cells_fail(json.dumps(nb)))
    assert [c["metadata"].get("tags") for c in out["cells"]] == [
        [tm.VERSION_SPECIFIC, "raises-exception"],
        ["other"],
        None,
    ]
    assert tm.let_version_specific_cells_fail(tm.let_version_specific_cells_fail(json.dumps(nb))) == (
        tm.let_version_specific_cells_fail(json.dumps(nb))
    )


def test_the_floor_check_runs_each_notebook_up_to_its_last_version_specific_cell():
    """CI's floor check (--version-specific): the cells after the last version-specific one are left out, and
    a version-specific cell is not let fail: it must pass on every release the project declares."""
    nb = _nb([_code(), _code(tags=[tm.VERSION_SPECIFIC]), MD, _code(tags=[tm.VERSION_SPECIFIC]), _code(), MD])
    out = json.loads(tm.up_to_last_version_specific_cell(json.dumps(nb)))
    assert out["cells"] == nb["cells"][:4], out["cells"]
    assert all("raises-exception" not in c["metadata"].get("tags", []) for c in out["cells"]), out["cells"]
    plain = _nb([_code(), MD])
    assert json.loads(tm.up_to_last_version_specific_cell(json.dumps(plain))) == plain
    paths = tm.version_specific_paths(REPO, [])
    assert paths and all(not p.startswith(("notebooks/solutions", "notebooks/zh-CN")) for p in paths), paths
    for rel in tm.notebook_paths(REPO, True, []):
        cells = json.loads((REPO / rel).read_text())["cells"]
        tagged = any(tm.VERSION_SPECIFIC in c.get("metadata", {}).get("tags", []) for c in cells)
        assert (rel in paths) == tagged, (rel, tagged, paths)


def _src(source, tags=()):
    return {**_code(tags=tags), "source": source}


def test_the_floor_check_runs_only_the_cells_its_version_specific_cells_need():
    """By the names they read, the last cell to bind each before; os.chdir, %load_ext and %%writefile always;
    the other code cells emptied, so a verdict's cell index is the file's. Where a cell cannot be read, or a
    version-specific cell runs on the ranks, every cell up to the last runs."""
    cells = [
        _src("import os\nos.chdir('x')"),
        _src("%%writefile scripts/a.py\nprint(1)"),
        _src("result = torchrun('scripts/a.py')  # slow, and nobody needs it"),
        MD,
        _src("rec = {r['k']: r for r in run()}\n!echo hi"),
        _src("from helpers import run"),  # binds run after the cell that reads it: not needed for it
        _src("rec['x'] = 1"),  # changes rec
        _src("for r in rec: print(r)\nassert rec['x'] == 1, rec", tags=[tm.VERSION_SPECIFIC]),
        _src("late = 1"),
    ]
    cells.insert(4, _src("def run():\n    return helper()"))
    cells.insert(4, _src("helper = list"))
    out = json.loads(tm.version_specific_slice(json.dumps(_nb(cells))))
    kept = [i for i, c in enumerate(out["cells"]) if c["cell_type"] == "code" and c["source"]]
    assert len(out["cells"]) == 10 and kept == [0, 1, 4, 5, 6, 8, 9], [c["source"] for c in out["cells"]]
    unreadable = [*cells[:2], _src("x = (1,"), cells[9]]
    out = json.loads(tm.version_specific_slice(json.dumps(_nb(unreadable))))
    assert [c["source"] for c in out["cells"]] == [c["source"] for c in unreadable], out
    on_ranks = [_src("a = 1"), _src("%%ranks\nb = a", tags=[tm.VERSION_SPECIFIC])]
    assert all(c["source"] for c in json.loads(tm.version_specific_slice(json.dumps(_nb(on_ranks))))["cells"])


FLOOR = {"minor": "2.8", "torch": "2.8.0", "torchvision": "0.23.0", "exclude": [], "why": ""}


def _run(argv, tmp_path, monkeypatch, run_version):
    """A run of ``argv`` with its cache in ``tmp_path``, pip's pairing and each version's run replaced (by the
    floor's pair and by ``run_version``); what it reports: its exit code."""
    cache = tm.Cache(tmp_path)
    args = tm.parse_args(argv, cache)
    monkeypatch.setattr(tm, "resolve", lambda minor, torches, cache: FLOOR)
    monkeypatch.setattr(tm, "run_version", run_version)
    fresh = tm.run(tm.choose_minors(args, [], tm.declared_floor(), PINNED), [], args, PINNED, cache)
    return tm.report([], fresh, args, PINNED)


def test_a_check_fails_on_a_notebook_the_floor_check_ran_and_that_failed(tmp_path, monkeypatch):
    ran = []
    verdict = {
        "status": "fail",
        "cell": 18,
        "error": "AttributeError: no __deprecated__",
        "version_specific": True,
    }

    def run_version(pair, args, pinned, cache, folder):
        ran.append((pair["torch"], args.version_specific))
        failed = {"results": {"notebooks/10_collectives.ipynb": verdict}}
        return {**pair, "notebooks": failed} if pair["torch"] == "2.8.0" else dict(pair)

    assert _run(["--floor", "--check", "--version-specific"], tmp_path, monkeypatch, run_version) == 1
    assert ran == [("2.14.1", True), ("2.8.0", True)], ran  # the pinned reference first
    assert tm.notebook_failures([{"torch": "2.8.0", "notebooks": {"results": {"n.ipynb": verdict}}}]) == [
        "2.8.0 n.ipynb: fail in cell 18: AttributeError: no __deprecated__"
    ]
    verdict["status"] = "pass"
    assert _run(["--floor", "--check", "--version-specific"], tmp_path, monkeypatch, run_version) == 0


def _row(torch_version, tv, notebooks=None, cases=None, date="2026-12-01"):
    row = {
        "minor": ".".join(torch_version.split(".")[:2]),
        "torch": torch_version,
        "torchvision": tv,
        "date": date,
    }
    if notebooks is not None:
        row["notebooks"] = {"date": date, "results": notebooks}
    if cases is not None:
        row["scripts"] = {"date": date, "cases": cases}
    return row


def test_the_table_has_one_dated_row_per_version_the_version_first():
    crash = {
        "failed": True,
        "raised": ["AttributeError"],
        "hung": False,
        "stuck": [],
        "records": [],
        "error": "JobFailedError: rank 0 raised AttributeError (exit code 1).\nAttributeError: a | b",
    }
    rows = [
        _row(
            "2.6.0",
            "0.21.0",
            {
                "notebooks/00_start_here.ipynb": {"status": "pass"},
                "notebooks/05_launching.ipynb": {
                    "status": "hang",
                    "cell": 14,
                    "error": "timed",
                    "source": {"commit": "bcdef0123456", "edited": True},
                },
            },
            {"00_hello": _case(crash), "00_crash": _case(crash)},
        ),
        _row(
            "2.14.1",
            "0.29.1",
            {"notebooks/00_start_here.ipynb": {"status": "pass"}},
            {"00_hello": _case(OK), "00_crash": _case(crash)},
        ),
        {
            "minor": "2.15",
            "torch": None,
            "torchvision": None,
            "date": "2026-12-02",
            "why": "no torchvision 0.30.x",
        },
    ]
    rows[0]["scripts"]["source"] = {"commit": "abcdef012345", "edited": False}  # and 00: stored without one
    lines = tm.render_table(rows, PINNED).splitlines()
    header = "| torch | torchvision | date | tree | scripts | " + " | ".join(tm.NOTEBOOK_COLUMNS) + " |"
    assert lines[0] == header
    assert tm.NOTEBOOK_COLUMNS[:2] == ["00 quickstart", "00 start"], tm.NOTEBOOK_COLUMNS  # a word per 00
    assert "09" in tm.NOTEBOOK_COLUMNS  # every notebook of the series
    body = [ln for ln in lines[2:] if ln.startswith("| ")]
    assert [ln.split(" | ")[0] for ln in body] == ["| 2.6.0", "| 2.14.1 (pinned)", "| 2.15"]
    assert body[0].startswith(
        "| 2.6.0 | 0.21.0 | 2026-12-01 | abcdef0: scripts; ?: 00 start; bcdef01+: 05 | "
        "1/2: `00_hello` fails [1] | not run | pass |"
    ), body[0]
    assert "| hangs in cell 14 [2] |" in body[0]
    # no source stored
    assert body[1].startswith("| 2.14.1 (pinned) | 0.29.1 | 2026-12-01 | ? | 2/2 | not run | pass |")
    assert body[2].startswith("| 2.15 | none | 2026-12-02 | ? | not run: no torchvision 0.30.x |")
    assert "1. 2.6.0, 00_hello: rank 0: AttributeError: a \\| b" in lines
    assert "2. 2.6.0, 05: timed" in lines


def test_write_table_replaces_only_between_the_markers(tmp_path):
    original = (REPO / tm.TABLE_PAGE).read_text()
    before, rest = original.split(tm.MARKERS[0], 1)
    after = rest.split(tm.MARKERS[1], 1)[1]
    text = tm.replace_between_markers(original, "new table\n")
    assert text == before + tm.MARKERS[0] + "\nnew table\n" + tm.MARKERS[1] + after
    assert (
        tm.replace_between_markers(text, "again\n")
        == before + tm.MARKERS[0] + "\nagain\n" + tm.MARKERS[1] + after
    )
    with pytest.raises(ValueError):
        tm.replace_between_markers("no markers\n", "x\n")


def test_store_keeps_the_parts_a_later_run_did_not_redo(tmp_path):
    tm.store(_row("2.6.0", "0.21.0", cases={"00_hello": _case(OK), "08_train": _case(OK)}), tmp_path)
    tm.store(
        _row("2.6.0", "0.21.0", notebooks={"notebooks/00_start_here.ipynb": {"status": "pass"}}), tmp_path
    )
    again = _row("2.6.0", "0.21.0", cases={"08_train": _case({"failed": True})})
    again["scripts"]["only"] = "08_"
    tm.store(again, tmp_path)
    (row,) = tm.load_results(tmp_path)
    assert sorted(row["scripts"]["cases"]) == ["00_hello", "08_train"] and row["notebooks"]["results"]
    assert row["scripts"]["cases"]["08_train"]["cold"] == {"failed": True}
    tm.store(_row("2.6.1", "0.21.1", notebooks={}), tmp_path)  # another pair for the same minor starts afresh
    (row,) = tm.load_results(tmp_path)
    assert row["torch"] == "2.6.1" and "scripts" not in row


def test_run_child_kills_the_whole_tree_on_timeout(tmp_path):
    """A child that starts a grandchild in a session of its own (as a Jupyter kernel does) and then hangs:
    both are gone when run_child returns, and the child ran at a lower priority."""
    pidfile = tmp_path / "pids"
    (tmp_path / "hang.py").write_text(
        "import os, subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "                     start_new_session=True)\n"
        f"open({str(pidfile)!r} + '.tmp', 'w').write(f'{{os.getpid()}} {{g.pid}} {{os.nice(0)}}')\n"
        f"os.replace({str(pidfile)!r} + '.tmp', {str(pidfile)!r})\n"  # whole, or not there at all
        "time.sleep(600)\n"
    )
    # run_child's 5 s count from its Popen, and a child at nice 10 on a busy machine may take longer than
    # that to start Python and its grandchild. The runner's Popen.wait therefore first waits for the event,
    # the pidfile (the grandchild runs, the child is about to sleep): the 5 s start once the tree is there.
    runner = textwrap.dedent("""
        import os, pathlib, subprocess, sys, time, types
        sys.path.insert(0, sys.argv[1])
        import torch_matrix as tm

        p = pathlib.Path(sys.argv[3])

        class TimedFromThePidfile(subprocess.Popen):
            def wait(self, timeout=None):
                end = time.monotonic() + 60  # a safety net: the test then fails on the missing pidfile
                while not (p / "pids").exists() and self.poll() is None and time.monotonic() < end:
                    time.sleep(0.05)
                return super().wait(timeout)

        tm.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": TimedFromThePidfile})
        tm.become_subreaper()
        r = tm.run_child([sys.executable, sys.argv[2]], log=p / "log", timeout=5, cwd=p, env=os.environ)
        print(r["timed_out"])
    """)
    done = subprocess.run(
        [sys.executable, "-c", runner, str(REPO / "tools"), str(tmp_path / "hang.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip() == "True", done.stderr
    child, grandchild, nice = (int(x) for x in pidfile.read_text().split())
    assert nice >= 10
    for pid in (child, grandchild):
        state = (
            Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if Path(f"/proc/{pid}").exists()
            else "gone"
        )
        assert state in ("gone", "Z"), f"process {pid} outlived run_child"
    assert "killed after 5 s" in (tmp_path / "log").read_text()


def test_every_case_of_warm_fidelity_has_its_own_key():
    tree = ast.parse((REPO / "benchmarks" / "warm_fidelity.py").read_text())
    cases = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CASES"
    )
    keys = [tm.case_key(script, args) for script, args, _, _ in cases]
    assert len(set(keys)) == len(keys), keys
    assert {case for case, *_ in tm.NAMED} <= set(keys), "a named difference for a case that does not exist"


def _block(readme: str) -> str:
    """What a page holds between the two torch-matrix markers."""
    return (REPO / readme).read_text().split(tm.MARKERS[0], 1)[1].split(tm.MARKERS[1], 1)[0]


def _table(readme: str) -> list[list[str]]:
    block = _block(readme)
    rows = [ln for ln in block.splitlines() if ln.startswith("| ") and not ln.startswith("| torch |")]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in rows]


def test_the_table_covers_every_minor_release_from_the_floor():
    """One row per minor release, the version first, from the floor pyproject.toml declares to the newest
    one tried, none missing; each dated; the pinned release among them. The table is in MEASURES.md only; both
    READMEs link its section."""
    rows = _table(tm.TABLE_PAGE)
    minors = [tm.minor_of(r[0]) for r in rows]
    floor = tm.declared_floor()
    assert minors[0] == floor, (
        f"the table starts at {minors[0]}, the floor is {floor}: rerun tools/torch_matrix.py"
    )
    assert minors == [(2, m) for m in range(floor[1], minors[-1][1] + 1)], minors
    assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2}(, \d{4}-\d{2}-\d{2})?", r[2]) for r in rows), [
        r[2] for r in rows
    ]
    assert any(r[0] == f"{PINNED['torch']} (pinned)" for r in rows), [r[0] for r in rows]
    for readme in ("README.md", "README.zh-CN.md"):
        text = (REPO / readme).read_text()
        assert "MEASURES.md#tested-torch-versions" in text and tm.MARKERS[0] not in text, (
            f"{readme} must link MEASURES.md#tested-torch-versions, not give the table itself"
        )


def test_the_table_is_what_the_committed_results_render():
    """The table is data, not prose: tools/torch-matrix-results/ holds what each run stored, and MEASURES.md
    gives exactly what tools/torch_matrix.py --table renders from it (so a hand edit, or a run whose results
    were not committed, fails here)."""
    rows = [r for r in tm.load_results(tm.RESULTS) if tm.minor_of(r["minor"]) >= tm.declared_floor()]
    assert rows, f"no results in {tm.RESULTS}: run tools/torch_matrix.py and commit what it stores"
    block = _block(tm.TABLE_PAGE).strip("\n")
    assert block == tm.render_table(rows, tm.pinned_pair()).strip("\n"), (
        "MEASURES.md's torch-matrix table is not what the committed results render: "
        "run .venv/bin/python tools/torch_matrix.py --table --write-table"
    )


def test_a_check_stores_in_the_cache_not_with_the_table(tmp_path, monkeypatch):
    """CI's --check stores its runs in the cache, so a local .ci/run leaves the table's data as committed; a
    run without --check stores with the table, in a folder git tracks."""
    stored: list[Path] = []

    def run_version(pair, args, pinned, cache, folder):
        stored.append(folder)
        return dict(pair)

    assert _run(["--floor", "--check"], tmp_path, monkeypatch, run_version) == 0
    assert stored == [tmp_path / "results"] * 2, stored  # the pinned reference and the floor
    stored.clear()
    assert _run(["--floor"], tmp_path, monkeypatch, run_version) == 0
    assert stored == [tm.RESULTS], stored
    ignored = subprocess.run(
        ["git", "-C", str(REPO), "check-ignore", "-q", str(tm.RESULTS / "torch-2.8.json")]
    )
    assert ignored.returncode == 1, f"{tm.RESULTS} must be tracked, not ignored"


def test_ci_runs_every_script_and_every_version_specific_cell_on_the_floor():
    ci = (REPO / ".ci" / "run").read_text()
    assert "tools/torch_matrix.py --floor --check --warm-only" in ci, "CI must run the scripts on the floor"
    assert "--floor --check --warm-only --version-specific" in ci, "and the version-specific cells"
    assert "--floor --prepare --version-specific" in ci, "in an environment made for the notebooks"
    assert ci.index("--floor --check") > ci.index('bash -c "$cmd"'), (
        "after the README test command, with .venv"
    )


def test_a_warm_only_reference_is_compared_with_both_launches():
    """--check runs the pinned version's launches warm only: the floor's cold and warm launches are compared
    with that one launch."""
    reference = {"warm": OK, "seconds": {}}
    assert tm.script_verdict("00_hello", _case(OK), reference, (2, 8)) == ("pass", "")
    changed = dict(OK, records=[{"rank": 0, "loss": 0.5, "warned": True}])
    assert tm.script_verdict("00_hello", _case(changed), reference, (2, 8))[0] == "differs"
    assert tm.script_verdict("00_hello", {"warm": OK}, None, (2, 14)) == ("pass", "")  # the reference itself


def test_a_solutions_notebook_that_was_run_gets_a_column():
    rows = [
        _row(
            "2.8.0",
            "0.23.0",
            {"notebooks/solutions/06_capstone_image_classifier_solutions.ipynb": {"status": "pass"}},
        )
    ]
    lines = tm.render_table(rows, PINNED).splitlines()
    assert lines[0].endswith(f"| {tm.NOTEBOOK_COLUMNS[-1]} | 06 sol. |") and lines[2].endswith(
        "| not run | pass |"
    ), lines


def _warm_fidelity_cases() -> list:
    tree = ast.parse((REPO / "benchmarks" / "warm_fidelity.py").read_text())
    return next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CASES"
    )


def test_every_script_of_the_series_is_a_case_of_the_matrix():
    """What CI's floor check and the matrix run: every Python script in notebooks/scripts (the batch scripts
    of notebook 05 section 7 need SLURM: they run in the notebook, where the practice cluster is up)."""
    scripts = {p.name for p in (REPO / "notebooks" / "scripts").glob("*.py")}
    cased = {script for script, *_ in _warm_fidelity_cases()}
    assert scripts - cased == set(), f"scripts no case of benchmarks/warm_fidelity.py runs: {scripts - cased}"
    assert cased - scripts == set(), cased - scripts


def test_a_hang_is_told_from_a_failure():
    hung = {"failed": True, "raised": [], "hung": True, "stuck": [1], "records": []}
    assert tm.script_verdict("00_hang", _case(hung), {"warm": hung}, (2, 9)) == ("pass", "")
    assert tm.script_verdict("00_hello", {"warm": hung}, {"warm": OK}, (2, 9))[0] == "hangs"
    assert tm.script_verdict("00_hello", {"warm": dict(hung, hung=False)}, {"warm": OK}, (2, 9))[0] == "fails"


def test_a_notebook_whose_slurm_cells_did_not_run_says_so():
    rows = [
        _row(
            "2.8.0",
            "0.23.0",
            {"notebooks/05_launching.ipynb": {"status": "pass", "slurm_not_run": "no SLURM here: skipped"}},
        )
    ]
    text = tm.render_table(rows, PINNED)
    assert "| pass, SLURM cells not run [1] |" in text, text
    assert "1. 2.8.0, 05: the SLURM cells did not submit jobs: no SLURM here: skipped" in text, text


def test_the_scripts_alone_get_torch_and_torchvision_only(tmp_path, monkeypatch):
    """CI's floor check installs what the scripts import; the notebooks add the project and its dependencies
    to that environment, and an environment made for them serves the scripts too."""
    cache = tm.Cache(tmp_path)
    steps = []

    def fake_run_child(cmd, **kwargs):
        steps.append([str(c) for c in cmd])
        if "venv" in steps[-1]:
            Path(steps[-1][-1]).mkdir(parents=True)
        return {"rc": 0, "timed_out": False, "seconds": 0, "leftovers": []}

    monkeypatch.setattr(tm, "run_child", fake_run_child)
    pair = {"torch": "2.8.0", "torchvision": "0.23.0", "exclude": []}
    python, info = tm.ensure_env(pair, cache, notebooks=False)
    assert not info["reused"] and [s[-2:] for s in steps] == [
        ["venv", str(tmp_path / "envs" / "torch-2.8.0-tv0.23.0")],
        ["torch==2.8.0", "torchvision==0.23.0"],
    ], steps
    assert tm.ensure_env(pair, cache, notebooks=False)[1]["reused"] and len(steps) == 2
    steps.clear()
    assert not tm.ensure_env(pair, cache, notebooks=True)[1]["reused"]
    assert len(steps) == 1 and "-e" in steps[0] and "venv" not in steps[0], steps  # added, not made anew
    assert all(tm.ensure_env(pair, cache, notebooks=n)[1]["reused"] for n in (False, True))


def test_only_the_blamed_ranks_exception_is_compared():
    """A peer torchrun stops may raise on its way out (gloo: "Connection closed by peer"), or not: a race.
    Seen on the floor: 00_crash's rank 0 raised RuntimeError in one launch and not in the pinned one."""
    error = (
        "JobFailedError: rank 1 raised ValueError (exit code 1); then 1 other rank(s) stopped too: rank 0 "
    )
    one = {
        "failed": True,
        "raised": ["ValueError"],
        "hung": False,
        "stuck": [],
        "records": [],
        "error": error,
    }
    both = dict(
        one, raised=["RuntimeError", "ValueError"], error=error + "raised RuntimeError (exit code 1)."
    )
    assert tm.script_verdict("00_crash", {"warm": both}, {"warm": one}, (2, 8)) == ("pass", "")
    other = dict(one, error=error.replace("ValueError", "KeyError"))
    assert tm.script_verdict("00_crash", {"warm": other}, {"warm": one}, (2, 8))[0] == "differs"


def test_a_second_run_on_the_same_cache_is_refused(tmp_path):
    """Two runs would each replace the copy of the tree the other runs from (it happened: a run's scripts then
    failed with FileNotFoundError)."""
    cache = tm.Cache(tmp_path)
    first = tm.hold_cache_lock(cache)
    assert first is not None and tm.hold_cache_lock(cache) is None
    first.close()
    again = tm.hold_cache_lock(cache)
    assert again is not None
    again.close()
