"""GPU check: run the series' scripts on a CUDA machine (NCCL, one rank per GPU) and report what was seen.

Not part of CI (CI has no GPU). Usage, from the repository root on a GPU machine:
    PYTHONPATH=$PWD python benchmarks/gpu_check.py
Every check prints one JSON line {"check": ..., "ok": ..., ...}; the exit code is the number of failed checks.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from ddp_helpers import describe_environment, torchrun

import capstone_scaling  # beside this file (python puts the script's folder on sys.path)

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
failures = 0


def check(name: str):
    def wrap(fn):
        global failures
        try:
            detail = fn() or {}
            print(json.dumps({"check": name, "ok": True, **detail}), flush=True)
        except Exception as e:  # report and go on: one run must say as much as it can
            failures += 1
            print(json.dumps({"check": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:3000]}), flush=True)
            traceback.print_exc()
        return fn
    return wrap


def run(script: str, *args: str, nproc: int = 1, timeout: float = 300, **kw):
    return torchrun(f"scripts/{script}", *args, nproc_per_node=nproc, timeout=timeout, cwd=NOTEBOOKS, live=False, **kw)


info = describe_environment()
gpus = info["gpu_count"]
assert gpus >= 1, "this check needs a CUDA GPU"


@check("00_hello on NCCL, one rank per GPU")
def _():
    result = run("00_hello.py", "--steps", "2", nproc=gpus)
    recs = result.records()
    assert {r["backend"] for r in recs} == {"nccl"}, recs
    assert {r["device"] for r in recs} == {f"cuda:{i}" for i in range(gpus)}, recs
    assert all(r["sum"] == gpus * (gpus + 1) / 2 for r in recs), recs
    return {"records": recs[:2], "seconds": round(result.duration, 1)}


@check("backend='nccl' with more ranks than GPUs gives advice")
def _():
    try:
        run("00_hello.py", nproc=gpus + 1, backend="nccl")
    except RuntimeError as e:
        assert "needs one GPU per rank" in str(e), e
        return {"message": str(e)[:200]}
    raise AssertionError("no error")


def scripts_exit_zero(cases: list[tuple[str, list[str]]], nproc: int = 1) -> dict:
    out = {}
    for script, args in cases:
        result = run(script, *args, nproc=nproc)
        out[f"{script} {' '.join(args)}".strip()] = {"seconds": round(result.duration, 1),
                                                     "devices": sorted({str(r.get("device")) for r in result.records() if r.get("device")})}
    return out


@check("01 checkpoints: NCCL, map_location to cuda:0")
def _():
    recs = run("01_checkpoints.py", "--out", "runs/gpu01").records()
    load = [r for r in recs if r.get("case") == "load_every_rank"]
    assert load and all(r["device"] == "cuda:0" and r["loaded_device"] == "cuda:0" for r in load), load
    assert all(r["after"][0] == r["trained"] or abs(r["after"][0] - r["trained"]) < 1e-6 for r in load), load
    return {"load": load}


@check("02 sampler cases on one GPU")
def _():
    from ddp_helpers import make_image_folder
    make_image_folder(NOTEBOOKS / "data" / "shapes", num_classes=4, images_per_class=5, size=16, seed=0)
    return scripts_exit_zero([("02_sampler.py", ["--cases", "grid,rank_source,image_folder,evaluate,global_batch",
                                                 "--data", "data/shapes"])])


@check("03 real nn.SyncBatchNorm on CUDA, 1 rank (NCCL)")
def _():
    recs = run("03_sync_batchnorm.py").records()
    ref = [r for r in recs if r.get("case") == "reference"]
    assert ref and all(r["impl"] == "torch" for r in ref), ref
    assert all(max(r["max_abs_diff"].values()) < 1e-4 for r in ref), ref
    return {"reference": ref}


@check("03 real nn.SyncBatchNorm on CUDA, 2 ranks sharing the GPU over gloo")
def _():
    recs = run("03_sync_batchnorm.py", "--device", "cuda", "--impl", "torch", nproc=2, backend="gloo").records()
    ref = [r for r in recs if r.get("case") == "reference"]
    assert len(ref) == 2 and all(r["impl"] == "torch" and max(r["max_abs_diff"].values()) < 1e-4 for r in ref), ref
    return {"reference": ref}


@check("04, 05, 07 scripts exit 0 on one GPU")
def _():
    return scripts_exit_zero([("04_ddp.py", []), ("04_seed_snippet.py", []), ("05_launch.py", []),
                              ("05_elastic.py", ["--snapshot", "runs/gpu05.pt"]), ("07_gallery.py", []),
                              ("07_tools.py", [])])


@check("06 capstone on one GPU: NCCL, SyncBatchNorm, learns; figures")
def _():
    from ddp_helpers import make_image_folder
    data = make_image_folder(NOTEBOOKS / "data" / "capstone", num_classes=4, images_per_class=64, size=16,
                             seed=0, val_fraction=0.25)
    recs = run("06_train.py", "--data", str(data), "--out", "runs/gpu06").records(rank=0)
    start = next(r for r in recs if r["event"] == "start")
    done = next(r for r in recs if r["event"] == "done")
    assert start["backend"] == "nccl" and start["device"] == "cuda:0", start
    assert done["val_acc"] >= 0.9, done
    big = make_image_folder(NOTEBOOKS / "data" / "bench", num_classes=4, images_per_class=320, size=32, seed=0,
                            val_fraction=0.2)
    common = ["--data", str(big), "--num-epochs", "4", "--batch-size", "32"]
    figures = {name: round(capstone_scaling.run(f"{name} @{capstone_scaling.SPLIT}", common))
               for name in ("DDP 1 rank", "plain python")}  # measured as the scaling benchmark measures them
    return {"val_acc": done["val_acc"], "samples_per_s": figures}


@check("08 template on one GPU: float16 with GradScaler (scale saved), bfloat16, NCCL device_id")
def _():
    from ddp_helpers import make_image_folder
    import torch
    data = make_image_folder(NOTEBOOKS / "data" / "capstone", num_classes=4, images_per_class=64, size=16,
                             seed=0, val_fraction=0.25)
    seen = {}
    for amp in ("fp16", "bf16"):
        recs = run("08_train.py", "--data", str(data), "--out", f"runs/gpu08_{amp}", "--amp", amp).records(rank=0)
        epoch = next(r for r in recs if r["event"] == "epoch")
        done = next(r for r in recs if r["event"] == "done")
        assert next(r for r in recs if r["event"] == "start")["backend"] == "nccl", recs[0]
        assert epoch["dtypes"]["activations"] == {"fp16": "torch.float16", "bf16": "torch.bfloat16"}[amp], epoch
        assert done["history"][-1]["val_acc"] >= 0.9, done
        seen[amp] = {"dtypes": epoch["dtypes"], "val_acc": done["history"][-1]["val_acc"]}
    scaler = torch.load(NOTEBOOKS / "runs" / "gpu08_fp16" / "last.pt", map_location="cpu", weights_only=True)["scaler"]
    assert scaler["scale"] > 0, scaler
    return {**seen, "fp16_scale_in_checkpoint": scaler["scale"]}


sys.exit(failures)
