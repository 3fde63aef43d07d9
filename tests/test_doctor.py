"""``python -m ddp_helpers.doctor``: passes here, names a bad GLOO_SOCKET_IFNAME, never shows a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ddp_test_support import REPO

from ddp_helpers import doctor, pins

NAMES = [
    "python",
    "platform",
    "torch",
    "torchvision",
    "jupyterlab",
    "torch.distributed",
    "network settings",
    "shell variables",
    "loopback ports",
    "2-rank all_reduce",
    "CPU cores",
    "shared memory",
    "disk space",
    "GPUs",
    "Jupyter kernel",
]


def doctor_run(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", *doctor.STALE_VARS)}
    # a safety net only (the doctor's own 2-rank job stops at 180 s), below pytest-timeout's 600 s so that
    # a failure shows this bound and what the doctor printed
    return subprocess.run(
        [sys.executable, "-m", "ddp_helpers.doctor", *args],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=420,
    )


def test_doctor_passes_here():
    text = doctor_run()
    assert text.returncode == 0, text.stdout + text.stderr
    for name in NAMES:
        assert any(line.startswith(f"✓ {name}: ") for line in text.stdout.splitlines()), (name, text.stdout)
    assert (
        "✓ 2-rank all_reduce: torchrun with 2 ranks over loopback (gloo), sum 3.0 on both ranks"
        in text.stdout
    )


def test_missing_gloo_interface_is_named_before_any_launch(monkeypatch, capsys):
    """In-process (the doctor as a command is test_doctor_passes_here's): a bad GLOO_SOCKET_IFNAME fails its
    line and the 2-rank job is not even started."""
    for name in doctor.STALE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    assert doctor.main([]) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert any(
        line.startswith("✗") and "GLOO_SOCKET_IFNAME" in line and "nosuchif0" in line
        for line in text.splitlines()
    ), text
    assert "unset GLOO_SOCKET_IFNAME or set it to one of lo" in text
    assert "✗ 2-rank all_reduce: not run" in text  # short-circuited: no job was started
    assert "Traceback" not in text
    assert doctor.main(["--json"]) == 1
    report = json.loads(capsys.readouterr().out)  # one object, for a room
    assert report["ok"] is False and [c["name"] for c in report["checks"]] == NAMES, report
    assert {c["name"]: c["status"] for c in report["checks"]}["network settings"] == "fail", report


def test_the_gpu_line_says_what_a_launch_gets(monkeypatch):
    """The doctor's GPU line follows environment.launch_backend, as the launcher does (no GPU here: faked)."""
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Fake GPU")
    for gpus, nccl, status, words in [
        (0, True, "pass", "no GPU: the notebooks use gloo on the CPU"),
        (1, True, "pass", "the notebooks' 2-rank launches run on gloo and the CPU"),
        (2, True, "pass", "2 GPU(s) (Fake GPU, Fake GPU), NCCL available"),
        (1, False, "warn", "this torch has no NCCL, which the scripts pick"),
    ]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        monkeypatch.setattr(dist, "is_nccl_available", lambda nccl=nccl: nccl)
        check = doctor.check_gpus()
        assert check.status == status and words in check.detail, (gpus, nccl, check)


def test_version_comparison_ignores_local_suffix_only():
    assert doctor.compare_version("torch", "2.14.1+cu130", "2.14.1", "2.8").status == "pass"
    assert doctor.compare_version("torch", "2.14.1rc1", "2.14.1", "2.8").status == "pass"
    assert doctor.compare_version("jupyterlab", "4.6.6", None, "4.1").status == "pass"


def test_not_the_pinned_version_warns_and_below_the_floor_fails():
    other = doctor.compare_version("torch", "2.13.0+cpu", "2.14.1", "2.8")
    assert other.status == "warn" and "not the pinned version" in other.detail, other
    assert "version-specific cells may differ" in other.detail, other
    assert doctor.compare_version("torch", "2.8.0", "2.14.1", "2.8").status == "warn"  # the floor itself
    assert doctor.compare_version("torch", "2.15.0", "2.14.1", "2.8").status == "warn"  # newer than tested
    old = doctor.compare_version("torch", "2.7.1+cu126", "2.14.1", "2.8")
    assert old.status == "fail" and "unsupported" in old.detail and ">= 2.8" in old.detail, old
    assert doctor.compare_version("torchvision", "0.22.1", "0.29.1", "0.23").status == "fail"


def test_the_floors_come_from_pyproject():
    floors = pins.read_floors(REPO / "pyproject.toml")
    assert floors["torch"] == "2.8" and floors["torchvision"] == "0.23", floors


def test_read_pins_skips_comments(tmp_path):
    path = tmp_path / "constraints.txt"
    path.write_text("# torch==1.0\ntorch==2.14.1  # tested\n\nTorch_Vision==0.29.1\nnumpy>=1\n")
    assert pins.read_pins(path) == {"torch": "2.14.1", "torch-vision": "0.29.1"}


def test_a_crashing_check_becomes_a_failed_line(monkeypatch, capsys):
    def broken() -> doctor.Check:
        raise OSError("no sockets today")

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(doctor, "check_loopback", broken)
    monkeypatch.setattr(doctor, "check_job", lambda timeout: doctor.Check("pass", "skipped"))
    assert doctor.main([]) == 1
    out = capsys.readouterr()
    assert "✗ loopback ports: the check itself raised OSError: no sockets today" in out.out
    assert "✓ Jupyter kernel" in out.out and "Traceback" not in out.out + out.err


def test_the_platform_line_says_what_each_system_allows():
    assert doctor.check_platform("Linux").status == "pass"
    mac = doctor.check_platform("Darwin")
    assert mac.status == "warn" and "no NCCL" in mac.detail and "spawn" in mac.detail, mac
    windows = doctor.check_platform("Windows")
    assert windows.status == "fail" and "WSL 2" in windows.fix and "libuv" in windows.detail, windows
    assert doctor.check_platform("FreeBSD").status == "warn"
    assert [name for name, _ in doctor.checks(60)][:2] == ["python", "platform"]
