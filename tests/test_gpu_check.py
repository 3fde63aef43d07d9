"""benchmarks/gpu_check.py on a machine without GPUs: its 2+ GPU checks each say what they skipped, and why.

The script itself runs by hand on a lent GPU machine; here, only the path a CPU (or a single GPU) takes
through its NCCL hang checks, which must not launch anything and must leave the run green.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ddp_test_support import REPO


def test_without_two_gpus_the_nccl_hang_checks_say_what_they_skipped():
    env = {**os.environ, "GPU_CHECK_ON_CPU": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--skip-notebooks", "--only", "2+ GPUs"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    names = [line["check"] for line in lines]
    for notebook in ("04's hang on NCCL", "07's hang on NCCL", "10's %%ranks on NCCL"):
        assert any(notebook in name for name in names), names
    assert all(line["ok"] and line["skipped"] == "needs 2+ GPUs (one per rank), found 0" for line in lines), (
        lines
    )
    assert len(lines) == 8, names  # 4 cases of 04, 3 of 07, and 10's %%ranks
