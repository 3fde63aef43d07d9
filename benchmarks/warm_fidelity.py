"""Fidelity of warm launches: every script of the series, launched warm and cold, must report the same.

Runs each script of ``notebooks/scripts`` the way its notebook does, once with ``warm=False`` (a fresh
torchrun process) and once warm, and compares what the ranks printed: the JSON records with timing fields left
out, or, for the scripts that fail or hang on purpose, which rank was blamed, how it ended and why. Prints one
line per script and exits non-zero if any differs.
Usage: ``python benchmarks/warm_fidelity.py [NAME_PREFIX] [--json FILE]`` (about 3 minutes on 2 cores; it
writes to the git-ignored notebooks/runs/ and notebooks/data/).
``--json`` also writes every launch's outcome, with its error's text and its duration, one JSON object a line:
``tools/torch_matrix.py`` runs this on each torch version and compares what the versions report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

from ddp_helpers import TorchrunError, make_image_folder, torchrun

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
TIMING = ("time", "seconds", "duration", "samples_per_s", "ratio")  # measured, so different in every run
PER_LAUNCH = (
    "MASTER_PORT",
    "master_port",
    "TORCHELASTIC_RUN_ID",
    "pid",
    "pgid",
    "main_pid",
)  # new each launch
COUNTED = (
    "tcp_opened",
    "worker_pids",
)  # ports and process ids, new each launch: how many is what they report


def _untimed(value: object) -> object:
    if isinstance(value, dict):
        return {
            k: len(v) if k in COUNTED and isinstance(v, list) else _untimed(v)
            for k, v in value.items()
            if not any(t in k for t in TIMING) and k not in PER_LAUNCH
        }
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def outcome(script: str, *args: str, warm: bool, fresh: list[str] = (), **kwargs) -> dict:
    """What a launch reported, timings aside: its records, or how it failed (with the error's text under
    ``"error"``, which the comparison leaves out: it names processes and ports)."""
    for name in fresh:  # outputs of the other launch, removed so that both start alike
        path = NOTEBOOKS / name
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    try:
        # a case with a folder of its own (cwd=) names the script by its absolute path, as notebook 12 does
        path = str(NOTEBOOKS / "scripts" / script) if "cwd" in kwargs else f"scripts/{script}"
        result = torchrun(path, *args, live=False, warm=warm, **{"timeout": 300, **kwargs})
    except TorchrunError as err:
        # The exception of the rank blamed, the first to fail; not which rank that was when several raise at
        # once, nor what the others did: a peer that torchrun stops may raise first (gloo's "Connection closed
        # by peer") or not, and its exit code may be -6 or -15 instead of 1 (a race: see notebook 00).
        raised = re.findall(r"^rank \d+ raised (\w+)", str(err))[:1]
        return {
            "failed": True,
            "raised": raised,
            "hung": err.hung,  # stopped by timeout= or stall_timeout=
            "stuck": err.stuck_ranks,
            "records": _untimed(err.result.records()),
            "error": f"{type(err).__name__}: {err}",
        }
    return {"failed": False, "records": _untimed(result.records()), "exitcodes": result.exitcodes}


def comparable(found: dict) -> dict:
    return {k: v for k, v in found.items() if k != "error"}


CASES = [  # (script, args, launch keywords, folders to clear before each launch)
    ("00_single.py", ["--num-epochs", "1"], {"nproc_per_node": 1}, []),
    (
        "00_ddp.py",
        ["--num-epochs", "2", "--checkpoint", "runs/fidelity00/checkpoint.pt"],
        {"nproc_per_node": 2},
        ["runs/fidelity00"],
    ),
    ("00_hello.py", ["--steps", "3"], {"nproc_per_node": 2}, []),
    ("00_crash.py", [], {"nproc_per_node": 2}, []),
    ("00_hang.py", [], {"nproc_per_node": 2, "stall_timeout": 3}, []),
    (
        "01_checkpoints.py",
        ["--out", "runs/fidelity01", "--steps", "5"],
        {"nproc_per_node": 2, "backend": "gloo"},
        ["runs/fidelity01"],
    ),
    (
        "02_sampler.py",
        ["--cases", "grid,image_folder,evaluate,global_batch", "--data", "data/shapes", "--batch-size", "3"],
        {"nproc_per_node": 3, "backend": "gloo"},
        [],
    ),
    ("03_sync_batchnorm.py", [], {"nproc_per_node": 2}, []),
    ("04_ddp.py", [], {"nproc_per_node": 2}, []),
    ("04_seed_snippet.py", [], {"nproc_per_node": 2}, []),
    ("05_seed_snippet.py", ["--world_size", "2"], {"nproc_per_node": 2, "backend": "gloo"}, []),
    ("05_launch.py", [], {"nproc_per_node": 2, "backend": "gloo"}, []),
    (
        "05_elastic.py",
        ["--snapshot", "runs/fidelity05.pt", "--crash-at-epoch", "2"],
        {"nproc_per_node": 2, "backend": "gloo", "torchrun_args": ["--max-restarts=1"]},
        ["runs/fidelity05.pt"],
    ),
    (
        "06_train.py",
        ["--data", "data/capstone", "--num-epochs", "2", "--out", "runs/fidelity06", "--num-workers", "2"],
        {"nproc_per_node": 2},
        ["runs/fidelity06"],
    ),
    ("07_gallery.py", ["--checkpoint", "runs/fidelity07.pt"], {"nproc_per_node": 2, "backend": "gloo"}, []),
    ("07_gallery.py", ["--case", "early-exit", "--buggy"], {"nproc_per_node": 2, "backend": "gloo"}, []),
    ("07_tools.py", ["--case", "monitored-barrier"], {"nproc_per_node": 2, "backend": "gloo"}, []),
    (
        "08_train.py",
        [
            "--data",
            "data/capstone",
            "--num-epochs",
            "2",
            "--out",
            "runs/fidelity08",
            "--amp",
            "bf16",
            "--num-workers",
            "2",
            "--persistent-workers",
            "--resume",
            "--crash-after-epoch",
            "0",
        ],
        {"nproc_per_node": 2, "torchrun_args": ["--max-restarts=1"]},
        ["runs/fidelity08"],
    ),
    ("08_memory.py", [], {"nproc_per_node": 2, "backend": "gloo"}, []),
    # 05 §7's two ranks on one stream: the launcher reads each rank's stream apart, so the records show each
    # rank's lines in order and whether its stdout was unbuffered; 20 lines each way show that as 2000 do.
    ("05_lines.py", ["--lines", "20"], {"nproc_per_node": 2}, []),
    ("09_failures.py", ["--steps", "0", "--fail", "raise"], {"nproc_per_node": 2, "backend": "gloo"}, []),
    # Every case notebook 09 runs on the CPU (load-device, same-gpu and watchdog need two GPUs).
    ("09_training.py", ["--case", "checkpoint"], {"nproc_per_node": 2, "backend": "gloo"}, []),
    ("09_training.py", ["--case", "batchnorm"], {"nproc_per_node": 2, "backend": "gloo"}, []),
    ("09_training.py", ["--case", "loss"], {"nproc_per_node": 2, "backend": "gloo"}, []),
    ("09_training.py", ["--case", "scaling"], {"nproc_per_node": 2, "backend": "gloo"}, []),
    ("09_training.py", ["--case", "workers"], {"nproc_per_node": 2, "backend": "gloo"}, []),
    ("09_training.py", ["--case", "logging"], {"nproc_per_node": 2, "backend": "gloo"}, []),
    (
        "09_training.py",
        ["--case", "flight-recorder", "--out", "runs/fidelity09"],
        {"nproc_per_node": 2, "backend": "gloo"},
        ["runs/fidelity09"],
    ),
    ("10_collectives.py", [], {"nproc_per_node": 2}, []),
    # Notebook 11: a case of each script whose records name no process or port.
    ("11_launching.py", ["--case", "before-init"], {"nproc_per_node": 2, "backend": "gloo"}, []),
    ("11_ddp.py", ["--case", "unfreeze"], {"nproc_per_node": 2, "backend": "gloo"}, []),
    (
        "11_data.py",
        ["--case", "prepare", "--out", "runs/fidelity11"],
        {"nproc_per_node": 2, "backend": "gloo"},
        ["runs/fidelity11"],
    ),
    # Notebook 12: the seed post's script (it stops where there is no GPU, as notebook 12 shows) and the fixed
    # one, both in a folder holding what they read (seed_post_folder); and the exercise's script.
    (
        "12_seed_post.py",
        ["--world_size", "2", "--epochs", "1", "--batchsize", "8"],
        {"nproc_per_node": 2, "cwd": "runs/fidelity12"},
        [],
    ),
    (
        "12_seed_fixed.py",
        ["--epochs", "1", "--batchsize", "8"],
        {"nproc_per_node": 2, "backend": "gloo", "cwd": "runs/fidelity12"},
        [],
    ),
    (
        "12_exercise.py",
        ["--checkpoint", "runs/fidelity12/exercise/checkpoint.pt"],
        {"nproc_per_node": 2, "backend": "gloo"},
        ["runs/fidelity12/exercise"],
    ),
]


def seed_post_folder(folder: str) -> None:
    """What notebook 12's post_folder gives the seed post's scripts: shared/ and the D.pth snippet 6 loads."""
    torch.manual_seed(0)
    # the scripts' Model, saved as the post's DDP model saves it: every key under "module."
    pretrained = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    os.makedirs(os.path.join(folder, "shared"), exist_ok=True)
    torch.save({"module." + k: v for k, v in pretrained.state_dict().items()}, os.path.join(folder, "D.pth"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "only", nargs="?", default="", help='only the scripts whose name starts so, e.g. "08_"'
    )
    parser.add_argument(
        "--json", type=Path, help="also write every launch's outcome here, one JSON object a line"
    )
    parser.add_argument("--warm-only", action="store_true", help="warm launches only, nothing compared")
    args = parser.parse_args(argv)
    log = args.json.resolve() if args.json else None
    os.chdir(NOTEBOOKS)
    make_image_folder("data/shapes", num_classes=4, images_per_class=5, size=16, seed=0)
    make_image_folder("data/capstone", num_classes=4, images_per_class=64, size=16, seed=0, val_fraction=0.25)
    seed_post_folder("runs/fidelity12")
    differ = 0
    cases = [case for case in CASES if case[0].startswith(args.only)]
    for script, script_args, kwargs, fresh in cases:
        start = time.perf_counter()
        runs = {}
        for warm in (True,) if args.warm_only else (False, True):
            began = time.perf_counter()
            try:
                runs[warm] = outcome(script, *script_args, warm=warm, fresh=fresh, **kwargs)
            except Exception as err:  # the launcher itself failed (on another torch version, say): go on
                runs[warm] = {"failed": True, "launcher_error": f"{type(err).__name__}: {err}"}
            if log:
                line = {
                    "script": script,
                    "args": script_args,
                    "warm": warm,
                    "outcome": runs[warm],
                    "seconds": round(time.perf_counter() - began, 1),
                }
                with open(log, "a", encoding="utf-8") as f:
                    f.write(json.dumps(line, default=str) + "\n")
        if args.warm_only:
            continue
        same = comparable(runs[False]) == comparable(runs[True])
        differ += not same
        what = "failed alike" if runs[False].get("failed") else f"{len(runs[False]['records'])} records alike"
        print(
            f"{'same' if same else 'DIFFERENT'}  {script} {' '.join(script_args)}: "
            f"{what if same else runs}  ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    print(f"{len(cases) - differ} of {len(cases)} launches reported the same warm and cold")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
