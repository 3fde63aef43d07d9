"""GPU check: what only a CUDA machine can show, as one script that fits in a few minutes.

Not part of CI (CI has no GPU). It runs, in this order (the most important first, so that a run cut short
still says the most):
  1. notebook 08's template: float16 + GradScaler with --deterministic, an uninterrupted run against one that
     crashes after epoch 1 and is restarted by torchrun --max-restarts=1 and resumes: bit-identical weights
     (asserted); two uninterrupted runs with and without --deterministic (reported);
  2. notebook 01's map_location cases on cuda (the checkpoint loads onto the rank's GPU);
  3. every notebook's script on NCCL, one rank per GPU (00-07), SyncBatchNorm on CUDA, the capstone's figures;
  4. with 2+ GPUs (one per rank), what the notebooks pin gloo for, on NCCL: the hangs of 04 and 07, each as
     the notebook launches it and then left alone under a 10 s process-group timeout (NCCL's watchdog line,
     the flight recorder's dump, exit codes, seconds), and 10's %%ranks (a lone all_reduce on rank 0, then a
     cell on both ranks); recorded, not asserted. With fewer GPUs each of these says it was skipped;
     `--only "2+ GPUs" --hang-backend gloo` (and GPU_CHECK_ON_CPU=1) rehearses them on the CPU;
  5. every notebook top to bottom under nbmake (each in its own copy of the repository, several at once).
Each check prints one JSON line {"check": ..., "ok": ..., ...}; the exit code is the number of failed checks.

Usage, from the repository root on a machine with CUDA and the test extras installed:
    PYTHONPATH=$PWD python benchmarks/gpu_check.py [--out DIR] [--skip-notebooks] [--solutions] [--jobs 5]
On a machine with torch but without Jupyter (this project's lent GPU machine), carry the wheels that
tools/gpu_wheels.sh downloads into .whl/ and install them first:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
        PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_check.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import capstone_scaling  # beside this file (python puts the script's folder on sys.path)

from ddp_helpers import RankGroup, TorchrunError, describe_environment, make_image_folder, torchrun

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
failures = 0


def check(name: str):
    """Run the decorated function now, print its JSON line, and count a failure instead of stopping."""

    def wrap(fn):
        global failures
        if cli.only and not any(word in name for word in cli.only):
            return fn
        started = time.monotonic()
        try:
            detail = fn() or {}
            ok = detail.pop("ok", True)
        except Exception as e:  # report and go on: one run must say as much as it can
            detail, ok = {"error": f"{type(e).__name__}: {e}"[:3000]}, False
            traceback.print_exc()
        failures += not ok
        print(
            json.dumps({"check": name, "ok": ok, "seconds": round(time.monotonic() - started, 1), **detail}),
            flush=True,
        )
        return fn

    return wrap


def run(script: str, *args: str, nproc: int = 1, timeout: float = 300, **kw):
    return torchrun(
        f"scripts/{script}", *args, nproc_per_node=nproc, timeout=timeout, cwd=NOTEBOOKS, live=False, **kw
    )


def capstone_data() -> Path:
    return make_image_folder(
        NOTEBOOKS / "data" / "capstone",
        num_classes=4,
        images_per_class=64,
        size=16,
        seed=0,
        val_fraction=0.25,
    )


def final_weights(folder: str) -> dict:
    import torch

    return torch.load(
        NOTEBOOKS / "runs" / "gpu08" / folder / "last.pt", map_location="cpu", weights_only=True
    )["model"]


def same_weights(a: str, b: str) -> bool:
    import torch

    wa, wb = final_weights(a), final_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--out", type=Path, help="folder for the summary and the notebooks' logs")
parser.add_argument("--skip-notebooks", action="store_true", help="only the script checks (1-3)")
parser.add_argument("--solutions", action="store_true", help="also the solutions notebooks")
parser.add_argument("--jobs", type=int, default=5, help="notebooks run at once")
parser.add_argument("--notebook-timeout", type=int, default=420, help="seconds for one notebook")
parser.add_argument(
    "--notebook-glob", default="[0-9][0-9]_*.ipynb", help="which notebooks (in notebooks/ and solutions/)"
)
parser.add_argument("--only", nargs="*", help="run only the checks whose names contain one of these words")
parser.add_argument(
    "--hang-backend",
    choices=("gloo",),
    help="pin the 2+ GPU hang checks to gloo: a rehearsal of their code on the CPU (with GPU_CHECK_ON_CPU=1)",
)
cli = parser.parse_args()

info = describe_environment(verbose=False)
gpus = info["gpu_count"]
# GPU_CHECK_ON_CPU=1 runs the harness on a CPU machine, to try it before spending GPU time (GPU checks fail).
assert gpus >= 1 or os.environ.get("GPU_CHECK_ON_CPU") == "1", "this check needs a CUDA GPU"
NPROC = max(1, min(2, gpus))  # NCCL needs one GPU per rank


@check("environment")
def _():
    import torch

    nccl = torch.cuda.nccl.version() if gpus else None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": info["gpus"],
        "python": info["python"],
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "cpu_count": info["cpu_count"],
    }


@check("08 fp16 + GradScaler + --deterministic: a crash restarted by torchrun resumes bit-identical")
def _():
    common = ["--data", str(capstone_data()), "--num-epochs", "4", "--accum", "2", "--amp", "fp16"]

    def out(name: str) -> list[str]:
        return ["--out", f"runs/gpu08/{name}"]

    shutil.rmtree(NOTEBOOKS / "runs" / "gpu08", ignore_errors=True)
    det = ["--deterministic"]
    first = run("08_train.py", *common, *det, *out("det_a"), nproc=NPROC).records()
    run("08_train.py", *common, *det, *out("det_b"), nproc=NPROC)
    restarted = run(
        "08_train.py",
        *common,
        *det,
        "--resume",
        "--crash-after-epoch",
        "1",
        *out("det_restart"),
        nproc=NPROC,
        torchrun_args=["--max-restarts=1"],
    ).records()
    run("08_train.py", *common, *out("free_a"), nproc=NPROC)
    run("08_train.py", *common, *out("free_b"), nproc=NPROC)
    starts = [(r["attempt"], r["start_epoch"]) for r in restarted if r.get("event") == "start"]
    assert starts == [(0, 0), (1, 2)], starts  # torchrun restarted the job, which resumed at epoch 2
    start = next(r for r in first if r.get("event") == "start")
    import torch

    scaler = torch.load(
        NOTEBOOKS / "runs" / "gpu08" / "det_a" / "last.pt", map_location="cpu", weights_only=True
    )["scaler"]
    epoch = next(r for r in first if r.get("event") == "epoch")
    seen = {
        "ranks": NPROC,
        "backend": start["backend"],
        "device": start["device"],
        "scale_in_checkpoint": scaler.get("scale"),
        "dtypes": epoch.get("dtypes"),
        "val_acc": [r for r in first if r.get("event") == "done"][0]["history"][-1]["val_acc"],
        "restarted_equals_uninterrupted": same_weights("det_a", "det_restart"),
        "two_deterministic_runs_equal": same_weights("det_a", "det_b"),
        "two_runs_without_deterministic_equal": same_weights("free_a", "free_b"),
    }
    seen["ok"] = (
        start["backend"] == "nccl"
        and seen["restarted_equals_uninterrupted"]
        and seen["two_deterministic_runs_equal"]
    )
    return seen


@check("01 checkpoints: NCCL, map_location to cuda:0")
def _():
    recs = run("01_checkpoints.py", "--out", "runs/gpu01").records()
    load = [r for r in recs if r.get("case") == "load_every_rank"]
    assert load and all(r["device"] == "cuda:0" and r["loaded_device"] == "cuda:0" for r in load), load
    assert all(abs(r["after"][0] - r["trained"]) < 1e-6 for r in load), load
    return {"load": load}


@check("00_hello on NCCL, one rank per GPU")
def _():
    result = run("00_hello.py", "--steps", "2", nproc=gpus)
    recs = result.records()
    assert {r["backend"] for r in recs} == {"nccl"}, recs
    assert {r["device"] for r in recs} == {f"cuda:{i}" for i in range(gpus)}, recs
    assert all(r["sum"] == gpus * (gpus + 1) / 2 for r in recs), recs
    return {"records": recs[:2]}


@check(
    "backend='nccl' with more ranks than GPUs gives advice; left to the script, such a launch runs on gloo"
)
def _():
    try:
        run("00_hello.py", nproc=gpus + 1, backend="nccl")
    except RuntimeError as e:
        assert "needs one GPU per rank" in str(e), e
    else:
        raise AssertionError("no error")
    recs = run("00_hello.py", "--steps", "1", nproc=gpus + 1).records()
    assert {r["backend"] for r in recs} == {"gloo"}, recs
    return {"fallback_backend": "gloo"}


def scripts_exit_zero(cases: list[tuple[str, list[str]]], nproc: int = 1) -> dict:
    out = {}
    for script, args in cases:
        result = run(script, *args, nproc=nproc)
        devices = sorted({str(r.get("device")) for r in result.records() if r.get("device")})
        out[f"{script} {' '.join(args)}".strip()] = {"seconds": round(result.duration, 1), "devices": devices}
    return out


@check("02 sampler cases on one GPU")
def _():
    make_image_folder(NOTEBOOKS / "data" / "shapes", num_classes=4, images_per_class=5, size=16, seed=0)
    return scripts_exit_zero(
        [
            (
                "02_sampler.py",
                ["--cases", "grid,rank_source,image_folder,evaluate,global_batch", "--data", "data/shapes"],
            )
        ]
    )


@check("03 real nn.SyncBatchNorm on CUDA, 1 rank (NCCL)")
def _():
    recs = run("03_sync_batchnorm.py").records()
    ref = [r for r in recs if r.get("case") == "reference"]
    assert ref and all(r["impl"] == "torch" for r in ref), ref
    assert all(max(r["max_abs_diff"].values()) < 1e-4 for r in ref), ref
    return {"reference": ref}


@check("03 real nn.SyncBatchNorm on CUDA, 2 ranks sharing the GPU over gloo")
def _():
    recs = run(
        "03_sync_batchnorm.py", "--device", "cuda", "--impl", "torch", nproc=2, backend="gloo"
    ).records()
    ref = [r for r in recs if r.get("case") == "reference"]
    assert len(ref) == 2 and all(
        r["impl"] == "torch" and max(r["max_abs_diff"].values()) < 1e-4 for r in ref
    ), ref
    return {"reference": ref}


@check("04, 05, 07 scripts exit 0 on one GPU")
def _():
    return scripts_exit_zero(
        [
            ("04_ddp.py", []),
            ("04_seed_snippet.py", []),
            ("05_launch.py", []),
            ("05_elastic.py", ["--snapshot", "runs/gpu05.pt"]),
            ("07_gallery.py", []),
            ("07_tools.py", []),
        ]
    )


@check("06 capstone on one GPU: NCCL, SyncBatchNorm, learns; figures")
def _():
    recs = run("06_train.py", "--data", str(capstone_data()), "--out", "runs/gpu06").records(rank=0)
    start = next(r for r in recs if r["event"] == "start")
    done = next(r for r in recs if r["event"] == "done")
    assert start["backend"] == "nccl" and start["device"] == "cuda:0", start
    assert done["val_acc"] >= 0.9, done
    big = make_image_folder(
        NOTEBOOKS / "data" / "bench", num_classes=4, images_per_class=320, size=32, seed=0, val_fraction=0.2
    )
    common = ["--data", str(big), "--num-epochs", "4", "--batch-size", "32"]
    # measured as the scaling benchmark measures them
    figures = {
        name: round(capstone_scaling.run(f"{name} @{capstone_scaling.SPLIT}", common))
        for name in ("DDP 1 rank", "plain python")
    }
    return {"val_acc": done["val_acc"], "samples_per_s": figures}


# ---- 2+ GPUs: the hang demonstrations on NCCL (issue 31) ---------------------------------------------------
# Notebooks 04, 07 and 10 pin gloo for their hangs; a learner on a machine with a GPU per rank who does not
# gets NCCL, where a collective only queues work on the GPU. Each case runs twice: as the notebook launches
# it (stall_timeout: the helper's diagnosis and where each rank's stack was), and left alone under a process
# group timeout of PG_TIMEOUT seconds (a wrapper sets it), to see what NCCL itself does: the watchdog's lines,
# the flight recorder's dump (TORCH_NCCL_DUMP_ON_TIMEOUT=1), the exit codes, how long. Nothing is asserted
# about NCCL: each check records what it saw. With fewer than 2 GPUs each says it was skipped; --hang-backend
# gloo rehearses the same code on the CPU.
PG_TIMEOUT = 10  # seconds
HANG_LIMIT = 90.0  # every launch's wall-clock limit (NCCL's own timeout here: PG_TIMEOUT)
SHORT_PG = """\
# gpu_check.py: run a series script with a short process-group timeout, to see NCCL's watchdog within seconds.
import datetime
import os
import runpy
import sys

import torch.distributed as dist

_init = dist.init_process_group


def init_process_group(*args, **kwargs):
    if kwargs.get("timeout") is None:
        kwargs["timeout"] = datetime.timedelta(seconds=float(os.environ["GPU_CHECK_PG_TIMEOUT"]))
    return _init(*args, **kwargs)


dist.init_process_group = init_process_group
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""
HANG_CASES = [  # (notebook, the script and its arguments, what the notebook shows on gloo)
    ("04", ["04_ddp.py", "--cases", "uneven_no_join"], "rank 0 waits inside backward"),
    ("04", ["04_ddp.py", "--cases", "join_all_gather"], "rank 0 waits in its metric all_gather"),
    ("04", ["04_ddp.py", "--cases", "join_all_reduce"], "gloo aborts rank 0, SIGABRT: the sizes differ"),
    ("04", ["04_ddp.py", "--cases", "eval_wrapper"], "rank 0 waits in DDP's buffer broadcast"),
    ("07", ["07_gallery.py", "--case", "rank0-barrier", "--buggy"], "each rank waits in its own barrier"),
    ("07", ["07_gallery.py", "--case", "save-in-branch", "--buggy"], "each rank waits in a different call"),
    ("07", ["07_tools.py", "--case", "late-rank", "--late", "40"], "rank 0 waits in all_reduce for rank 1"),
]


def two_gpus(name: str):
    """``check``, for what needs a GPU per rank: with fewer GPUs, one line that says what was skipped."""

    def wrap(fn):
        if gpus >= 2 or cli.hang_backend == "gloo":
            return check(name)(fn)
        if not cli.only or any(word in name for word in cli.only):
            why = f"needs 2+ GPUs (one per rank), found {gpus}"
            print(json.dumps({"check": name, "ok": True, "skipped": why}), flush=True)
        return fn

    return wrap


def script_frames(stack: str, limit: int = 3) -> list[str]:
    """The innermost frames of a stack dump in the scripts or a %%ranks cell, as ``file:line in f``."""
    frames = []
    for line in stack.splitlines():
        line = line.strip()
        if line.startswith("File ") and ("/scripts/" in line or "<ranks cell" in line):
            path, _, rest = line[len("File ") :].partition(", line ")
            frames.append(f"{Path(path.strip(chr(34))).name}:{rest}")
    return frames[:limit]


def seen_error(err: Exception, started: float) -> dict:
    """What a learner sees of a launch that did not finish: its kind, exit codes, first lines, how long."""
    seen: dict = {"seconds": round(time.monotonic() - started, 1), "error": type(err).__name__}
    if not isinstance(err, TorchrunError):
        return {**seen, "message": str(err)[:500]}
    seen["exitcodes"] = err.result.exitcodes
    seen["message"] = str(err).splitlines()[:3]
    if err.hung:  # the helper's diagnosis, and where each rank was
        seen["stuck_ranks"] = err.stuck_ranks
        seen["where"] = {r: script_frames(s) for r, s in err.stacks.items()}
    else:
        seen["rank"], seen["exitcode"] = err.rank, err.exitcode
        seen["last_stderr"] = {r: [line[:300] for line in v[-3:]] for r, v in err.result.stderr.items()}
    lines = [line for rank_lines in err.result.stderr.values() for line in rank_lines]
    nccl = re.compile(r"watchdog|flight ?recorder|heartbeat|dump", re.IGNORECASE)  # NCCL's own lines
    seen["nccl_lines"] = [line[:300] for line in lines if nccl.search(line) and "Traceback" not in line][:6]
    return seen


def hang_views(case: list[str], tag: str) -> dict:
    """A case as the notebook launches it, then left alone under a short process-group timeout."""
    out: dict = {"backend_pinned": cli.hang_backend or "none, as a learner launches it"}
    started = time.monotonic()
    try:
        result = run(*case, nproc=2, timeout=HANG_LIMIT, stall_timeout=5, backend=cli.hang_backend)
        out["as_the_notebook"] = {"finished": True, "seconds": round(result.duration, 1)}
    except Exception as err:  # any ending is what we came to see
        out["as_the_notebook"] = seen_error(err, started)
    dumps = (cli.out or Path(tempfile.gettempdir())) / "flight_recorder" / tag
    shutil.rmtree(dumps, ignore_errors=True)
    dumps.mkdir(parents=True)
    wrapper = NOTEBOOKS / "runs" / "gpu_check_short_pg.py"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text(SHORT_PG)
    env = {
        "GPU_CHECK_PG_TIMEOUT": PG_TIMEOUT,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": f"{dumps}/rank_",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # the flight recorder on every torch (the default since 2.11)
    }
    started = time.monotonic()
    try:
        result = torchrun(
            "runs/gpu_check_short_pg.py",
            f"scripts/{case[0]}",
            *case[1:],
            nproc_per_node=2,
            timeout=HANG_LIMIT,
            cwd=NOTEBOOKS,
            live=False,
            env=env,
            backend=cli.hang_backend,
        )
        left: dict = {"finished": True, "seconds": round(result.duration, 1), "exitcodes": result.exitcodes}
    except Exception as err:
        left = seen_error(err, started)
    left["pg_timeout"] = PG_TIMEOUT
    left["flight_recorder_files"] = sorted(f"{p.name} ({p.stat().st_size} B)" for p in dumps.iterdir())
    out["left_alone"] = left
    return out


for notebook, case, on_gloo in HANG_CASES:
    label = " ".join(case[1:]).replace("--cases ", "").replace("--case ", "")
    tag = f"{notebook}_{label.split()[0]}"  # the flight recorder's folder

    @two_gpus(f"2+ GPUs: {notebook}'s hang on NCCL, {case[0]} {label} (on gloo: {on_gloo})")
    def _(case=case, tag=tag):
        return hang_views(case, tag)


@two_gpus("2+ GPUs: 10's %%ranks on NCCL, a lone all_reduce on rank 0, then a cell on both ranks")
def _():
    seen: dict = {"backend_pinned": cli.hang_backend or "none, as %ranks start -n 2 picks it"}
    group = RankGroup(2, backend=cli.hang_backend, timeout=HANG_LIMIT, cwd=NOTEBOOKS)
    seen["backend"] = group.backend
    try:
        started = time.monotonic()
        try:
            value = group.run("dist.all_reduce(torch.ones(1, device=device))", [0], stall_timeout=5)
            seen["lone_all_reduce"] = {
                "returned": repr(value),
                "seconds": round(time.monotonic() - started, 1),
            }
        except Exception as err:  # on gloo: the hang notebook 10 shows, which ends the group
            seen["lone_all_reduce"] = seen_error(err, started)
            return seen
        started = time.monotonic()
        later = "t = torch.full((1,), rank + 1.0, device=device)\ndist.all_reduce(t)\nt.item()"
        try:
            value = group.run(later, stall_timeout=5)
            seen["later_cell_on_both"] = {
                "returned": repr(value),
                "seconds": round(time.monotonic() - started, 1),
            }
        except Exception as err:  # where the later sync waits
            seen["later_cell_on_both"] = seen_error(err, started)
    finally:
        group.stop()
    return seen


def run_notebook(nb: Path, logs: Path) -> dict:
    """One notebook under nbmake, in a fresh copy of the repository's tracked files (notebooks that run at
    once then never share a data or runs folder)."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        for rel in filter(None, files.decode().split("\0")):
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, Path(tmp) / rel)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))}
        started = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-o",
                "addopts=",
                "-q",
                "--nbmake",
                f"--nbmake-timeout={cli.notebook_timeout}",
                str(nb.relative_to(ROOT)),
            ],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=cli.notebook_timeout + 120,
        )
    log = proc.stdout + proc.stderr
    (logs / f"{nb.stem}.log").write_text(log)
    tail = [line for line in log.splitlines() if line.strip()][-12:]
    return {
        "notebook": str(nb.relative_to(NOTEBOOKS)),
        "ok": proc.returncode == 0,
        "seconds": round(time.monotonic() - started, 1),
        **({} if proc.returncode == 0 else {"tail": tail}),
    }


if not cli.skip_notebooks:

    @check("every notebook top to bottom under nbmake")
    def _():
        logs = cli.out or Path(tempfile.mkdtemp(prefix="gpu_check_logs_"))
        logs.mkdir(parents=True, exist_ok=True)
        chosen = sorted(NOTEBOOKS.glob(cli.notebook_glob)) + (
            sorted((NOTEBOOKS / "solutions").glob(cli.notebook_glob)) if cli.solutions else []
        )
        with ThreadPoolExecutor(max_workers=cli.jobs) as pool:
            results = list(pool.map(lambda nb: run_notebook(nb, logs), chosen))
        for r in results:
            print(json.dumps({"notebook_result": r}), flush=True)
        return {
            "passed": sum(r["ok"] for r in results),
            "of": len(results),
            "failed": [r["notebook"] for r in results if not r["ok"]],
            "logs": str(logs),
            "ok": all(r["ok"] for r in results),
        }


if cli.out:
    cli.out.mkdir(parents=True, exist_ok=True)
    (cli.out / "summary.json").write_text(json.dumps({"failures": failures}))
sys.exit(failures)
