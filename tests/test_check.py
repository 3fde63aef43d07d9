"""``ddp_helpers.check`` and ``python -m ddp_helpers check``: a learner's script run and checked.

Two halves. The comparison across ranks is pure functions over observations (``checker.analyse``), tested
with made-up ones as test_diagnose.py tests the launcher's diagnosis: each id found, and nothing found on a
clean run. Then real launches of ``check_scripts/train.py``, correct by default and wrong by ``--bugs``: each
id on a script that has the mistake, none on the one without it, grouped so that a launch shows several
findings that do not mask each other (eleven launches in all); the series' own templates check clean; and the
command line's exit codes and JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from ddp_test_support import REPO, clocks_start_when, in_native_call, in_python_call, rank_pids

from ddp_helpers import checker
from ddp_helpers.checker import CHECKS, CheckReport, Finding, Run, analyse, check

SCRIPTS = Path(__file__).parent / "check_scripts"
TRAIN = SCRIPTS / "train.py"
SCRIPT = "/work/train.py"
SOURCE = "\n".join(f"code on line {i}" for i in range(1, 101))
UNUSED = "Expected to have finished reduction in the prior iteration before starting a new one."


def ev(event: str, **fields: object) -> dict:
    return {"event": event, **fields}


def clean_events(world_size: int = 4, steps: int = 8, per_epoch: int = 4) -> dict[int, list[dict]]:
    """What a correct 2-epoch run reports: sharded batches, set_epoch, equal replicas, rank 0 saves."""
    events = {}
    for r in range(world_size):
        evs = [
            ev("start", rank=r, local_rank=r % 2, world_size=world_size, limit=20),
            ev("init", backend="gloo", rank=-1, world_size=-1, init_method=None, file=SCRIPT, line=10),
            ev(
                "ddp",
                model=0,
                step=0,
                find_unused_parameters=False,
                static_graph=False,
                sync_buffers=True,
                trainable=["fc.weight", "fc.bias"],
                frozen=[],
            ),
        ]
        for step in range(1, steps + 1):
            epoch, n = (step - 1) // per_epoch, step
            if (step - 1) % per_epoch == 0:
                evs.append(
                    ev(
                        "sampler",
                        sampler=0,
                        epoch=epoch,
                        rank=r,
                        num_replicas=world_size,
                        shuffle=True,
                        n=per_epoch * 2,
                        head=[r, epoch],
                        digest=f"e{epoch}r{r}",
                        step=step - 1,
                        forwards=n - 1,
                    )
                )
            samples = [f"s{r}-{n}-{i}" for i in range(2)]
            evs.append(ev("batch", n=n, step=step - 1, where="ddp", batch="".join(samples), samples=samples))
            evs.append(ev("buffers", model=0, n=n, step=step - 1, digests={"bn.running_mean": f"m{n}"}))
            evs.append(
                ev("step", step=step, params={"fc.weight": f"w{step}", "fc.bias": f"b{step}"}, unused=[None])
            )
        if r == 0:
            evs.append(
                ev("save", path="/work/runs/c.pt.tmp", prefixed=[], file=SCRIPT, line=30, library=False)
            )
            evs.append(ev("rename", src="/work/runs/c.pt.tmp", dst="/work/runs/c.pt"))
        evs.append(ev("load", path="/work/runs/c.pt", map_location=True, file=SCRIPT, line=40, library=False))
        evs.append(ev("end", how="finished", step=steps, group_alive=False))
        events[r] = evs
    return events


def made_up(events: dict[int, list[dict]] | None = None, world_size: int = 4, **fields: object) -> Run:
    stdout = {r: [] for r in range(world_size)}
    stdout[0] = ["epoch 0 loss 0.693", "epoch 1 loss 0.512"]
    fields.setdefault("stdout", stdout)
    events = clean_events(world_size) if events is None else events
    return Run(
        SCRIPT,
        fields.pop("source", SOURCE),
        world_size,
        fields.pop("steps", 20),
        events,
        cwd="/work",
        **fields,
    )


def replace(events: dict[int, list[dict]], who: int, kind: str, /, **changes: object) -> None:
    """Change every ``kind`` observation of rank ``who``."""
    for e in events[who]:
        if e["event"] == kind:
            e.update(changes)


def only(report: CheckReport, *ids: str) -> None:
    assert sorted(report.ids) == sorted(ids), (report.ids, str(report))


# ---- the comparison, on made-up observations ----------------------------------------------------------


def test_a_clean_run_passes_every_check():
    report = analyse(made_up())
    assert report.ok and report.findings == [] and report.not_run == [], str(report)
    assert report.passed == list(CHECKS)


def test_a_sampler_given_the_local_rank_trains_two_ranks_on_one_shard():
    events = clean_events()
    for r in (2, 3):  # node 1's ranks take node 0's shards
        replace(events, r, "sampler", rank=r - 2, num_replicas=2, digest=f"e0r{r - 2}")
    found = analyse(made_up(events)).finding("same-data-on-ranks")
    assert found.level == "error" and found.ranks == [0, 1, 2, 3]
    assert "ranks 2 gave their DistributedSampler rank=0, num_replicas=2" in found.evidence
    assert "ranks 0, 2 | 1, 3 drew the same 8 indices" in found.evidence
    assert found.see == "notebooks/02_distributed_sampler.ipynb §6"


def test_the_same_batches_on_every_rank_without_a_sampler():
    events = clean_events()
    for r in events:
        events[r] = [e for e in events[r] if e["event"] != "sampler"]
        for e in events[r]:
            if e["event"] == "batch":
                e["batch"], e["samples"] = f"b{e['n']}", [f"s{e['n']}-{i}" for i in range(2)]
    found = analyse(made_up(events)).finding("same-data-on-ranks")
    assert "ranks 0, 1, 2, 3 fed the model the same samples in the same order (8 of 8" in found.evidence
    assert found.see == "notebooks/02_distributed_sampler.ipynb §4" and "IterableDataset" in found.fix


def test_the_same_samples_in_another_order_on_each_rank():
    """Each rank shuffles the whole data set by itself: no two batches alike, but the same samples."""
    events = clean_events(world_size=2, steps=8)
    for r in events:
        events[r] = [e for e in events[r] if e["event"] != "sampler"]
        order = list(range(16)) if r == 0 else list(range(15, -1, -1))
        for e in events[r]:
            if e["event"] == "batch":
                e["samples"] = [f"s{i}" for i in order[2 * e["n"] - 2 : 2 * e["n"]]]
                e["batch"] = "".join(e["samples"])
    found = analyse(made_up(events, world_size=2)).finding("same-data-on-ranks")
    assert (
        "ranks 0, 1 trained on largely the same samples (ranks 0 and 1: 16 of their first 16)"
        in found.evidence
    )


def test_a_sharded_run_shares_no_more_than_the_samplers_padding():
    events = clean_events(world_size=2, steps=8)
    for e in events[1]:
        if e["event"] == "batch" and e["n"] == 8:
            e["samples"] = ["s0-1-0", "s1-8-1"]  # padding: the last item repeats another rank's first
    assert "same-data-on-ranks" in analyse(made_up(events, world_size=2)).passed


def test_an_order_that_repeats_across_epochs():
    events = clean_events()
    for r in events:
        replace(events, r, "sampler", epoch=0, digest=f"e0r{r}")  # set_epoch never called
    found = analyse(made_up(events)).finding("epoch-order-repeats")
    assert found.ranks == [0, 1, 2, 3] and "after 4 optimizer steps (its epoch still 0" in found.evidence


def test_the_same_epoch_read_twice_is_not_a_repeat():
    """00_ddp.py reads list(sampler) for its report, then the loader reads that epoch: no step between."""
    events = clean_events()
    for evs in events.values():
        first = next(e for e in evs if e["event"] == "sampler")
        evs.insert(evs.index(first), dict(first))
    assert "epoch-order-repeats" in analyse(made_up(events)).passed


def test_a_run_within_its_first_epoch_cannot_show_a_repeat():
    events = clean_events(steps=4)
    report = analyse(made_up(events))
    assert any(
        line.startswith("epoch-order-repeats: not run: the run ended within its first epoch")
        for line in report.not_run
    ), report.not_run


def test_parameters_that_differ_name_the_tensors_the_step_and_the_frozen_cause():
    events = clean_events()
    replace(events, 0, "ddp", trainable=["fc.bias"], frozen=["fc.weight"])
    for r in (1, 3):
        for e in events[r]:
            if e["event"] == "step" and e["step"] >= 3:
                e["params"]["fc.weight"] += f"-rank{r}"
    found = analyse(made_up(events)).finding("replicas-diverge")
    assert (
        "after optimizer step 3, 1 parameter tensor(s) differ between ranks (0, 2 | 1 | 3): `fc.weight`"
        in (found.evidence)
    )
    assert "did not require a gradient when DDP wrapped the model" in found.fix
    assert found.see == "notebooks/11_more_errors.ipynb §2e"


def test_a_rank_that_skips_a_step():
    events = clean_events()
    events[1] = [e for e in events[1] if not (e["event"] == "step" and e["step"] == 8)]
    for e in events[1]:
        if e["event"] == "step" and e["step"] >= 3:
            e["params"] = {k: v + "x" for k, v in e["params"].items()}
    found = analyse(made_up(events)).finding("replicas-diverge")
    assert (
        "rank 0 8, rank 1 7, rank 2 8, rank 3 8" in found.evidence and "no rank-dependent skip" in found.fix
    )


def test_buffers_that_differ_where_ddp_syncs_them():
    events = clean_events()
    replace(events, 0, "ddp", sync_buffers=False)
    for e in events[2]:
        if e["event"] == "buffers" and e["n"] >= 2:
            e["digests"] = {"bn.running_mean": "rank2"}
    found = analyse(made_up(events)).finding("replicas-diverge")
    assert "at training forward 2, where DDP synchronises buffers, 1 buffer(s) differed" in found.evidence
    assert "broadcast_buffers=False" in found.fix and found.see.endswith(
        "04_distributed_data_parallel.ipynb §8"
    )


def test_a_model_that_differs_across_ranks():
    message = (
        "DDP expects same model across all ranks, but Rank 0 has 2 params, while rank 1 has inconsistent 4"
    )
    events = {
        r: [ev("start", rank=r, local_rank=r, world_size=2, limit=20), ev("ddp_error", message=message)]
        for r in range(2)
    }
    run = made_up(events, world_size=2, failed_rank=0, failure="rank 0 raised RuntimeError (exit code 1)")
    report = analyse(run)
    only(report, "model-differs-across-ranks")
    assert (
        report.finding("model-differs-across-ranks").evidence == f"DDP refused to wrap the model: {message}"
    )


DUMP = """Current thread 0x00007f0000000002 (most recent call first):
  File "/site/torch/distributed/distributed_c10d.py", line 4000 in {call}
  File "/work/train.py", line {line} in main
  File "/site/ddp_helpers/_check_rank.py", line 400 in main
"""
BUSY = """Current thread 0x00007f0000000002 (most recent call first):
  File "/work/train.py", line 77 in evaluate
  File "/site/ddp_helpers/_check_rank.py", line 400 in main
"""


def test_a_hang_names_the_stuck_rank_and_where_the_others_wait():
    stacks = {0: BUSY, 1: DUMP.format(call="barrier", line=55), 2: DUMP.format(call="barrier", line=55)}
    run = made_up(
        clean_events(world_size=3), world_size=3, stuck=[0], stacks=stacks, hang="timed out after 9 s"
    )
    found = analyse(run).finding("rank-dependent-hang")
    assert found.evidence == (
        "the run timed out after 9 s: rank 0 never reached it: busy at train.py:77 (`code on line 77`); "
        "ranks 1, 2 wait in `barrier` at train.py:55 (`code on line 55`)"
    )
    assert found.ranks == [0, 1, 2] and found.see == "notebooks/07_debugging.ipynb §1a"


def test_a_slow_run_is_not_a_hang():
    run = made_up(clean_events(world_size=2), world_size=2, stuck=[0, 1], stacks={0: BUSY, 1: BUSY}, hang="x")
    report = analyse(run)
    assert "rank-dependent-hang" not in report.ids and "script-failed" not in report.ids
    assert any("no rank in a collective" in line for line in report.not_run)


def test_a_collective_whose_peer_has_left():
    events = clean_events(world_size=2)
    events[0][-1] = ev(
        "end",
        how="exception",
        type="RuntimeError",
        step=8,
        group_alive=True,
        line=61,
        message="[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:1",
    )
    run = made_up(events, world_size=2, failed_rank=0, failure="rank 0 raised RuntimeError (exit code 1)")
    report = analyse(run)
    found = report.finding("rank-dependent-hang")
    assert found.evidence.startswith(
        "rank 0 waited in a collective at train.py:61 (`code on line 61`) after rank(s) 1"
    )
    assert found.see == "notebooks/07_debugging.ipynb §1c" and "script-failed" not in report.ids


def test_every_rank_writing_one_file_through_its_own_temporary_name():
    events = clean_events()
    for r in (1, 2, 3):
        events[r].insert(-1, ev("save", path=f"/work/runs/c.pt.tmp{r}", prefixed=[], file=SCRIPT, line=30))
        events[r].insert(-1, ev("rename", src=f"/work/runs/c.pt.tmp{r}", dst="/work/runs/c.pt"))
    found = analyse(made_up(events)).finding("every-rank-saves")
    assert found.evidence.startswith("ranks 0, 1, 2, 3 all wrote runs/c.pt")


def test_files_of_their_own_per_rank_are_not_a_shared_save():
    events = clean_events()
    for r in (1, 2, 3):
        events[r].insert(-1, ev("save", path=f"/work/runs/c{r}.pt", prefixed=[], file=SCRIPT, line=30))
    assert "every-rank-saves" in analyse(made_up(events)).passed


def test_a_checkpoint_whose_keys_carry_module():
    events = clean_events()
    replace(
        events,
        0,
        "save",
        prefixed=[{"where": "['model']", "prefix": "module.", "key": "module.fc.weight", "keys": 2}],
    )
    found = analyse(made_up(events)).finding("checkpoint-prefix")
    assert found.evidence.startswith(
        "rank 0 saved runs/c.pt with every key of ['model'] starting with `module.`"
    )


def test_a_load_without_map_location_but_not_a_librarys_own():
    events = clean_events()
    replace(events, 1, "load", map_location=False)
    replace(events, 2, "load", map_location=False, library=True)  # torch.hub's own load, say
    found = analyse(made_up(events)).finding("load-without-map-location")
    assert found.level == "warning" and found.ranks == [1]
    assert found.evidence.startswith("torch.load(runs/c.pt) without map_location at train.py:40")


def test_unused_parameters_from_ddps_error_named():
    events = clean_events(world_size=2)
    replace(events, 0, "ddp", trainable=["fc.weight", "fc.bias", "spare.weight", "spare.bias"])
    message = f"{UNUSED} ... Parameter indices which did not receive grad for rank 0: 2 3\n In addition"
    events[0][-1] = ev("end", how="exception", type="RuntimeError", message=message, step=1, group_alive=True)
    report = analyse(made_up(events, world_size=2, failed_rank=0, failure="rank 0 raised RuntimeError"))
    found = report.finding("unused-parameters")
    assert found.level == "error" and "`spare.weight`, `spare.bias` got no gradient" in found.evidence
    assert "script-failed" not in report.ids


def test_find_unused_parameters_where_none_is_unused():
    events = clean_events()
    for r in events:
        replace(events, r, "ddp", find_unused_parameters=True)
        replace(events, r, "step", unused=[[]])
    found = analyse(made_up(events)).finding("unused-parameters")
    assert found.level == "warning" and "in each of the 8 steps observed" in found.evidence
    assert found.see == "notebooks/11_more_errors.ipynb §2c"
    for r in events:  # one step leaves a parameter out: the flag is needed
        events[r][-3]["unused"] = [["fc.bias"]]
    assert "unused-parameters" in analyse(made_up(events)).passed


def test_lines_every_rank_prints_alike_but_not_per_rank_records():
    stdout = {r: [f"epoch 0 loss 0.{r}93", json.dumps({"rank": r, "loss": r})] for r in range(4)}
    found = analyse(made_up(stdout=stdout)).finding("logs-from-every-rank")
    assert found.evidence == "every rank printed 1 line(s) alike (numbers aside), e.g. `epoch 0 loss 0.093`"


def test_a_group_never_destroyed():
    events = clean_events()
    for r in events:
        replace(events, r, "end", group_alive=True)
    assert analyse(made_up(events)).finding("no-destroy").ranks == [0, 1, 2, 3]
    for r in events:
        replace(events, r, "end", how="stopped", group_alive=True)
    assert "never names destroy_process_group" in analyse(made_up(events)).finding("no-destroy").evidence
    report = analyse(made_up(events, source=SOURCE + "\ndist.destroy_process_group()"))
    assert any(
        line.startswith("no-destroy: not run: the check stopped it after 20") for line in report.not_run
    )


def test_a_script_that_needs_cuda_is_not_called_broken_and_nothing_else_is_claimed():
    message = "RuntimeError: Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU"
    events = {
        r: [
            ev("start", rank=r, local_rank=r, world_size=2, limit=20),
            ev("end", how="exception", type="RuntimeError", message=message[14:], line=12, step=0),
        ]
        for r in range(2)
    }
    report = analyse(made_up(events, world_size=2, failed_rank=0, failure=f"rank 0 raised {message}"))
    only(report, "cuda-hardcoded")
    found = report.finding("cuda-hardcoded")
    assert report.ok and found.level == "warning" and "at train.py:12 (`code on line 12`)" in found.evidence
    assert len(report.not_run) == len(CHECKS) - 1 and report.passed == []


def test_init_process_group_given_the_local_rank():
    events = clean_events()
    for r in (2, 3):
        replace(events, r, "init", rank=r - 2, world_size=4)
    found = analyse(made_up(events)).finding("init-rank-mismatch")
    assert found.ranks == [2, 3] and found.evidence.startswith(
        "init_process_group at train.py:10 (`code on line 10`) was given rank=0 (its LOCAL_RANK) on global "
        "rank 2; rank=1 (its LOCAL_RANK) on global rank 3"
    )


def test_a_failure_nothing_else_explains_shows_the_ranks_traceback():
    stderr = {
        1: [
            "Traceback (most recent call last):",
            '  File "/work/train.py", line 50, in main',
            "    x = data[rank]",
            "IndexError: list index out of range",
        ]
    }
    events = clean_events(world_size=2)
    events[1][-1] = ev("end", how="exception", type="IndexError", message="list index out of range", line=50)
    report = analyse(
        made_up(events, world_size=2, failed_rank=1, failure="rank 1 raised IndexError", stderr=stderr)
    )
    found = report.finding("script-failed")
    assert found.ranks == [1] and found.evidence.endswith("IndexError: list index out of range")


def test_a_failure_the_series_reproduces_points_to_its_section():
    said = "ValueError: Error initializing torch.distributed using file:// rendezvous: rank parameter missing"
    stderr = {0: ["Traceback (most recent call last):", said]}
    events = clean_events(world_size=2)
    events[0][-1] = ev("end", how="exception", type="ValueError", message="rank parameter missing", line=20)
    run = made_up(events, world_size=2, failed_rank=0, failure="rank 0 raised ValueError", stderr=stderr)
    found = analyse(run).finding("script-failed")
    assert found.see == "notebooks/05_launching.ipynb §3" and "env://" in found.fix, found


def test_a_peer_failing_after_the_check_stopped_the_others_is_not_the_scripts_failure():
    events = clean_events(world_size=2)
    events[0][-1] = ev("end", how="stopped", step=8, group_alive=True)
    events[1][-1] = ev(
        "end", how="exception", type="RuntimeError", message="Connection closed by peer", step=7
    )
    report = analyse(made_up(events, world_size=2, failed_rank=1, failure="rank 1 raised RuntimeError"))
    assert "script-failed" not in report.ids and "rank-dependent-hang" not in report.ids


def test_an_error_of_the_checks_own_is_said_not_passed_off_as_a_finding():
    events = clean_events()
    events[1].insert(3, ev("check_error", where="record_batch", type="RuntimeError", message="odd tensor"))
    report = analyse(made_up(events))
    assert report.ok and report.findings == []
    assert report.not_run[-1].startswith("the check itself: its record_batch failed on rank 1 (RuntimeError")


def test_the_report_reads_as_a_checklist_and_its_json_is_the_issues_object():
    events = clean_events()
    replace(events, 1, "load", map_location=False)
    report = analyse(made_up(events), "4 ranks (2 nodes x 2)")
    text = str(report)
    assert text.startswith("ddp_helpers check: train.py on 4 ranks (2 nodes x 2): 0 errors, 1 warning\n⚠ ")
    assert "✓ same-data-on-ranks: no problem found" in text and "proof: notebooks/01_" in text
    assert report._repr_markdown_().startswith("**ddp_helpers check**: train.py on 4 ranks")
    as_json = report.as_json()
    assert set(as_json) == {"ok", "findings"} and as_json["ok"] is True
    assert set(as_json["findings"][0]) == {"id", "level", "ranks", "evidence", "fix", "see"}
    json.dumps(as_json)


def test_every_proof_a_finding_cites_is_a_section_that_exists():
    cited = set(re.findall(r"notebooks/(\d\d_\w+\.ipynb) §(\d+[a-z]?)", Path(checker.__file__).read_text()))
    assert len(cited) > 12
    for notebook, section in sorted(cited):
        cells = nbformat.read(REPO / "notebooks" / notebook, as_version=4).cells
        text = "\n".join(c.source for c in cells if c.cell_type == "markdown")
        assert re.search(rf"^#{{2,4}} {section}\. ", text, re.M), f"{notebook} has no section {section}"


def test_every_id_is_documented_in_the_readme_and_the_module():
    readme = (REPO / "README.md").read_text()
    for name in CHECKS:
        assert f"`{name}`" in readme, name
        assert f"``{name}``" in checker.__doc__, name


def test_the_check_rank_helpers_keep_keys_and_digests_exact():
    torch = pytest.importorskip("torch")
    from ddp_helpers import _check_rank

    assert _check_rank.strip_prefixes("_orig_mod.module.fc.weight") == "fc.weight"
    saved = {"model": {"module.a": torch.ones(1), "module.b": torch.ones(1)}, "epoch": 1}
    assert _check_rank.prefixed_state_dicts(saved) == [
        {"where": "['model']", "prefix": "module.", "key": "module.a", "keys": 2}
    ]
    assert _check_rank.prefixed_state_dicts({"model": {"a": torch.ones(1), "module.b": torch.ones(1)}}) == []
    x = torch.randn(4, 3)
    assert _check_rank.tensor_digest(x) == _check_rank.tensor_digest(x.clone().t().contiguous().t())
    assert _check_rank.tensor_digest(x) != _check_rank.tensor_digest(x + 1e-7)
    assert _check_rank.sample_digests(x)[1] == _check_rank.sample_digests(x[1:3])[0]


# ---- the command line, without a launch --------------------------------------------------------------


def test_bad_usage_exits_2_and_runs_nothing(capsys, monkeypatch):
    monkeypatch.setattr(checker, "check", lambda *a, **k: pytest.fail("nothing should run"))
    assert checker.main(["no_such_script.py"]) == 2
    assert "no such script: no_such_script.py" in capsys.readouterr().err
    assert checker.main(["--steps", "many", str(TRAIN)]) == 2
    assert "invalid int value" in capsys.readouterr().err
    assert checker.main(["--json"]) == 2


def test_exit_status_is_1_with_an_error_0_with_warnings_only(capsys, monkeypatch):
    warning = Finding("no-destroy", "warning", [0], "e", "f", "notebooks/11_more_errors.ipynb §4b")
    error = Finding(
        "every-rank-saves", "error", [0, 1], "e", "f", "notebooks/01_state_dict_prefixes.ipynb §2"
    )
    for findings, status in (([warning], 0), ([warning, error], 1)):
        monkeypatch.setattr(checker, "check", lambda *a, found=findings, **k: CheckReport("t.py", "w", found))
        assert checker.main(["--json", str(TRAIN), "--out", "x"]) == status
        printed = json.loads(capsys.readouterr().out)
        assert printed == {"ok": status == 0, "findings": [vars(f) for f in findings]}


def test_the_check_is_the_packages_function_and_imports_no_torch_in_the_kernel():
    code = (
        "import sys, ddp_helpers, ddp_helpers.checker, ddp_helpers.__main__; "
        "assert ddp_helpers.check is ddp_helpers.checker.check, ddp_helpers.check; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=300)


# ---- real launches -----------------------------------------------------------------------------------


def run_train(tmp_path: Path, bugs: str = "", **options: object) -> CheckReport:
    options.setdefault("timeout", 180)
    return check(TRAIN, "--out", tmp_path, "--bugs", bugs, **options)


def test_the_correct_script_checks_clean(tmp_path):
    report = run_train(tmp_path)
    assert report.ok and report.findings == [] and report.not_run == [], str(report)
    assert report.passed == list(CHECKS)


def test_eight_mistakes_at_once_each_found_with_its_evidence(tmp_path):
    bugs = "local-rank-sampler,no-set-epoch,every-rank-saves,prefix,no-map-location,print-every-rank"
    report = run_train(tmp_path, bugs + ",find-unused,no-destroy")
    only(
        report,
        "same-data-on-ranks",
        "epoch-order-repeats",
        "unused-parameters",
        "every-rank-saves",
        "checkpoint-prefix",
        "load-without-map-location",
        "logs-from-every-rank",
        "no-destroy",
    )
    same = report.finding("same-data-on-ranks").evidence
    assert "ranks 0, 2 gave their DistributedSampler rank=0, num_replicas=2" in same
    assert "ranks 0, 2 | 1, 3 fed the model the same samples in the same order (16 of 16" in same
    assert "its epoch still 0" in report.finding("epoch-order-repeats").evidence
    assert report.finding("unused-parameters").level == "warning"
    assert report.finding("every-rank-saves").evidence.startswith("ranks 0, 1, 2, 3 all wrote ")
    assert (
        "starting with `module.` (9 keys, e.g. `module.body.0.weight`)"
        in report.finding("checkpoint-prefix").evidence
    )
    assert "torch.load(path, weights_only=True)" in report.finding("load-without-map-location").evidence
    assert "`epoch 0 loss " in report.finding("logs-from-every-rank").evidence
    assert report.finding("no-destroy").ranks == [0, 1, 2, 3]
    assert [f.level for f in report.findings].count("error") == 4 and not report.ok


def test_replicas_that_drift_apart_parameters_and_buffers_and_a_stop_after_6_steps(
    tmp_path, kernel_unchanged
):
    report = run_train(tmp_path, "unfreeze,no-buffer-sync", steps=6)
    only(report, "replicas-diverge", "replicas-diverge")
    params, buffers = report.findings
    assert "after optimizer step 2, 2 parameter tensor(s) differ" in params.evidence
    assert "`body.0.bias`, `body.0.weight`" in params.evidence and params.see.endswith("§2e")
    assert (
        "`body.1.running_mean`, `body.1.running_var`" in buffers.evidence
        and "broadcast_buffers" in buffers.fix
    )
    # Stopped in its second epoch, before any save: every rank stopped cleanly, and what was not seen says so.
    assert (
        "no-destroy: not run: the check stopped it after 6 optimizer steps, before the script's end"
        in "\n".join(report.not_run)
    )
    assert "epoch-order-repeats" in report.passed and "script-failed" in report.passed


def test_a_parameter_no_loss_uses(tmp_path):
    report = run_train(tmp_path, "unused", nnodes=1)
    only(report, "unused-parameters")
    assert "`spare.weight`, `spare.bias` got no gradient" in report.finding("unused-parameters").evidence


def test_a_barrier_only_rank_0_reaches(tmp_path, kernel_unchanged):
    barrier = next(i for i, line in enumerate(TRAIN.read_text().splitlines(), 1) if "# BUG: inside" in line)

    def at_their_places() -> bool:
        pids = rank_pids(os.getpid(), str(TRAIN))
        return (
            len(pids) == 4
            and in_native_call(pids[0], "c10d::Work::wait", "barrier", at=("train.py", barrier))
            and all(
                in_native_call(
                    pids[r], "c10d::Work::wait", "DistributedDataParallel._distributed_broadcast_coalesced"
                )
                for r in (1, 2, 3)
            )
        )

    # The 2 s of silence count from rank 0 in its barrier and the others in DDP's next forward.
    with clocks_start_when(at_their_places):
        report = run_train(tmp_path, "hang", stall_timeout=2)
    only(report, "rank-dependent-hang")
    evidence = report.finding("rank-dependent-hang").evidence
    assert f"rank 0 waits in `barrier` at train.py:{barrier} (`dist.barrier()  # BUG: inside" in evidence
    assert "ranks 1-3 wait in `_distributed_broadcast_coalesced` at train.py:" in evidence


def test_a_device_hard_coded_to_cuda(tmp_path):
    report = run_train(tmp_path, "cuda", nnodes=1)
    only(report, "cuda-hardcoded")
    assert report.ok and "Found no NVIDIA driver" in report.finding("cuda-hardcoded").evidence


def test_init_process_group_given_the_local_rank_on_two_nodes(tmp_path):
    def inside_init() -> bool:
        pids = rank_pids(os.getpid(), str(TRAIN))
        return len(pids) == 4 and all(
            in_python_call(p, "init_process_group", "distributed_c10d.py") for p in pids.values()
        )

    # Each rank writes what init_process_group was given before calling it; 2 s count from all four inside.
    with clocks_start_when(inside_init):
        report = run_train(tmp_path, "init-rank", stall_timeout=2)
    only(report, "init-rank-mismatch")
    assert report.finding("init-rank-mismatch").ranks == [2, 3]


def test_the_quickstart_template_checks_clean(tmp_path):
    report = check(
        REPO / "notebooks/scripts/00_ddp.py", "--num-epochs", "2", "--checkpoint", tmp_path / "c.pt"
    )
    assert report.findings == [], str(report)
    # It never loads a checkpoint in a fresh run: that check does not apply, and says so.
    assert [line.split(":")[0] for line in report.not_run] == ["load-without-map-location"]


def test_the_real_training_template_checks_clean(tmp_path):
    """08_train.py, one epoch, then resumed for two more: its load (map_location="cpu") checked too."""
    from ddp_helpers import make_image_folder

    data = make_image_folder(
        tmp_path / "data", num_classes=4, images_per_class=16, size=16, val_fraction=0.25
    )
    script, args = (
        REPO / "notebooks/scripts/08_train.py",
        ["--data", data, "--out", tmp_path, "--batch-size", 4],
    )
    first = check(script, *args, "--num-epochs", 1)
    assert first.findings == [], str(first)
    resumed = check(script, *args, "--num-epochs", 3, "--resume")
    assert resumed.findings == [] and resumed.not_run == [], str(resumed)


def test_a_tutorial_shaped_script_has_one_true_finding(tmp_path):
    """trainer.py: a Trainer class, a peek at the first batch before set_epoch (a sampler pass that is not
    an epoch), progress lines tagged with the device index (not one line alike), a snapshot saved on
    LOCAL_RANK 0."""
    report = check(SCRIPTS / "trainer.py", "--snapshot", tmp_path / "snapshot.pt")
    only(report, "every-rank-saves")
    assert report.finding("every-rank-saves").evidence.startswith(
        "ranks 0, 2, each node's local rank 0, all wrote"
    )
    assert "epoch-order-repeats" in report.passed and "logs-from-every-rank" in report.passed


def test_the_command_line_exits_1_on_an_error_and_prints_the_json(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddp_helpers",
            "check",
            "--nnodes",
            "1",
            "--timeout",
            "180",
            "--json",
            str(TRAIN),
            "--out",
            str(tmp_path),
            "--bugs",
            "model-differs",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 1, done.stderr[-2000:]
    printed = json.loads(done.stdout)
    assert printed["ok"] is False and [f["id"] for f in printed["findings"]] == ["model-differs-across-ranks"]
    assert printed["findings"][0]["see"] == "notebooks/11_more_errors.ipynb §2a"
