"""``python -m ddp_helpers.doctor``: is this machine ready for the workshop? One line per check.

Statuses: ✓ pass, ⚠ warn (works, but read the line: exit code stays 0), ✗ fail (exit code 1).
Warnings: a single CPU core (two ranks share it: slow but correct), stale torchrun variables such
as RANK in the shell, GPUs without NCCL (the scripts would pick NCCL and fail: DDP_BACKEND=gloo avoids it),
a torch or torchvision other than the pinned one (supported from pyproject.toml's floor on, but the notebooks'
version-specific cells may differ); older than that floor is unsupported and fails.
Nothing here imports torch until a check runs, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata, util
from pathlib import Path

from ddp_helpers.pins import read_floors, read_pins, release

REPO = Path(__file__).resolve().parent.parent  # the clone's root when installed with `pip install -e .`
MIN_PYTHON = (3, 10)
MIN_SHM_MIB, MIN_DISK_MIB = 256, 2048
STALE_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
INSTALL = f"{sys.executable} -m pip install -c constraints.txt -e .  (in {REPO})"
MARK = {"pass": "✓", "warn": "⚠", "fail": "✗"}
JOB = """\
import json, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(json.dumps({"rank": dist.get_rank(), "sum": t.item()}), flush=True)
dist.destroy_process_group()
"""


@dataclass
class Check:
    """One check's outcome: status is "pass", "warn" or "fail"; fix says what to do when not "pass". A check
    returns it unnamed: ``run_check`` names it as ``checks()`` does."""

    name: str = field(default="", kw_only=True)
    status: str
    detail: str
    fix: str = ""


def compare_version(name: str, installed: str, pinned: str | None, floor: str | None = None) -> Check:
    """Installed version against its pin (a local suffix such as ``+cu130`` or ``+cpu`` ignored) and the
    project's floor: the pin passes; below the floor is unsupported (fail); anything else works but is not
    what the notebooks were run with (warn: their version-specific cells may differ)."""
    if floor is not None and release(installed) < release(floor):
        return Check("fail", f"{installed} is unsupported: the series needs {name} >= {floor}", INSTALL)
    if pinned is None:
        return Check("pass", f"{installed} (no pin in constraints.txt)")
    if release(installed) == release(pinned):
        return Check("pass", f"{installed} (pinned {pinned})")
    return Check(
        "warn",
        f"{installed}: not the pinned version ({pinned}): the notebooks' version-specific cells may differ "
        "(MEASURES.md, 'Tested torch versions', says which pass where)",
        INSTALL,
    )


def check_python() -> Check:
    """Python >= 3.10."""
    ok = sys.version_info >= MIN_PYTHON
    return Check(
        "pass" if ok else "fail",
        f"Python {platform.python_version()} (need >= 3.10)",
        "" if ok else "create the virtual environment with Python 3.10 or newer (3.11 is tested)",
    )


def check_platform(system: str | None = None) -> Check:
    """What the operating system allows: the series is tested on Linux (notebook 09 §8 has the rest)."""
    system = system or platform.system()
    if system == "Linux":
        return Check("pass", "Linux: gloo on the CPU, NCCL on NVIDIA GPUs (the series is tested here)")
    if system == "Darwin":
        return Check(
            "warn",
            "macOS: gloo on the CPU only (no NCCL; no backend handles MPS tensors); Python starts processes "
            "with spawn here, so scripts need their __main__ guard",
            "the notebooks run on the CPU as they are; notebook 09 §8 says what differs",
        )
    if system == "Windows":
        return Check(
            "fail",
            "Windows: gloo only (no NCCL), torchrun fails in builds without libuv, and the launcher needs "
            "POSIX process groups",
            "run the series under WSL 2 (a Linux build of torch); notebook 09 §8 explains",
        )
    return Check("warn", f"{system}: untested; the series is tested on Linux")


def check_package(name: str) -> Check:
    """An installed package, compared with its pin in constraints.txt and its floor in pyproject.toml."""
    if util.find_spec(name) is None:
        return Check("fail", "not installed", INSTALL)
    installed = metadata.version(name)
    constraints, pyproject = REPO / "constraints.txt", REPO / "pyproject.toml"
    if not constraints.is_file() or not pyproject.is_file():
        return Check("pass", f"{installed} (no clone next to the package: pin and floor not compared)")
    return compare_version(
        name, installed, read_pins(constraints).get(name), read_floors(pyproject).get(name)
    )


def check_distributed() -> Check:
    """torch.distributed and its gloo backend are built in."""
    import torch.distributed as dist

    ok = dist.is_available() and dist.is_gloo_available()
    return Check(
        "pass" if ok else "fail",
        "torch.distributed and gloo " + ("available" if ok else "not both available"),
        "" if ok else f"reinstall torch: {INSTALL}",
    )


def missing_interfaces() -> tuple[list[str], list[str]]:
    """Interfaces GLOO_SOCKET_IFNAME (comma-separated) names that do not exist, and those that do."""
    existing = [name for _, name in socket.if_nameindex()]
    wanted = [n.strip() for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n.strip()]
    return [n for n in wanted if n not in existing], existing


def check_network_settings() -> Check:
    """GLOO_SOCKET_IFNAME, if set, names interfaces that exist (else gloo fails in init_process_group)."""
    missing, existing = missing_interfaces()
    value = os.environ.get("GLOO_SOCKET_IFNAME")
    if missing:
        return Check(
            "fail",
            f"GLOO_SOCKET_IFNAME={value} names interface {', '.join(missing)}, "
            f"which does not exist; existing: {', '.join(existing)}",
            f"unset GLOO_SOCKET_IFNAME or set it to one of {', '.join(existing)}",
        )
    return Check("pass", f"GLOO_SOCKET_IFNAME={value}" if value else "GLOO_SOCKET_IFNAME not set")


def check_stale_variables() -> Check:
    """No torchrun variables left over in the shell (a stale ``export RANK=1``)."""
    found = [f"{v}={os.environ[v]}" for v in STALE_VARS if v in os.environ]
    if not found:
        return Check("pass", f"none of {', '.join(STALE_VARS)} set")
    return Check(
        "warn",
        f"set in this shell: {' '.join(found)} (torchrun overrides them, "
        "but a plain `python script.py` will think it is a rank)",
        f"unset {' '.join(v.split('=')[0] for v in found)}  (or open a fresh terminal)",
    )


def check_job(timeout: float) -> Check:
    """A real 2-rank torchrun job: all_reduce of rank+1 over loopback must give 3.0 on both ranks."""
    from ddp_helpers import TorchrunError, torchrun

    if missing_interfaces()[0]:
        return Check(
            "fail",
            "not run: GLOO_SOCKET_IFNAME names a missing interface (see network settings)",
            "fix the network settings line first",
        )
    with tempfile.TemporaryDirectory(prefix="ddp_doctor_") as tmp, warnings.catch_warnings():
        # the launcher's "more ranks than cores" warning: the cores line covers it
        warnings.simplefilter("ignore")
        Path(tmp, "doctor_job.py").write_text(JOB, encoding="utf-8")
        try:
            result = torchrun(
                "doctor_job.py", nproc_per_node=2, timeout=timeout, cwd=tmp, live=False, warm=False
            )
        except TorchrunError as e:
            how = str(e).splitlines()[0]
            err = [text.strip() for text in e.result.stderr.get(e.rank, []) if text.strip()]
            hint = (
                f"a busy machine may need more time: --timeout {max(2 * timeout, 600):g}; a firewall or VPN "
                "may block loopback"
                if e.hung
                else "read the error; check GLOO_SOCKET_IFNAME, VPN, firewall"
            )
            return Check("fail", how + (f" -- {err[-1][:300]}" if err else ""), hint)
    sums = {r["rank"]: r["sum"] for r in result.records() if "sum" in r}
    if sums == {0: 3.0, 1: 3.0}:
        return Check(
            "pass",
            f"torchrun with 2 ranks over loopback (gloo), sum 3.0 on both ranks, {result.duration:.1f} s",
        )
    return Check(
        "fail", f"ranks reported {sums}, expected 3.0 on ranks 0 and 1", "reinstall torch: " + INSTALL
    )


def check_loopback() -> Check:
    """A TCP socket can bind 127.0.0.1 on a free port and accept a connection."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass
    return Check("pass", f"bound and connected to 127.0.0.1:{port}")


def check_cores() -> Check:
    """CPU cores this process may use: 2 or more pass, 1 is a warning (two ranks share it, slowly)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores >= 2:
        return Check("pass", f"{cores} cores available (the notebooks run 2 ranks)")
    return Check(
        "warn",
        "1 core available: the notebooks run 2 ranks, which still works but slowly",
        "give the machine or VM 2 or more cores (taskset/cgroups may limit this process)",
    )


def free_space(path: str, need_mib: int, why: str, fix: str) -> Check:
    """Free space at ``path`` against a minimum in MiB."""
    free = shutil.disk_usage(path).free
    need = f"{need_mib // 1024} GiB" if need_mib >= 1024 else f"{need_mib} MiB"
    ok = free >= need_mib * 2**20
    return Check(
        "pass" if ok else "fail",
        f"{free / 2**30:.1f} GiB free in {path} (need >= {need}: {why})",
        "" if ok else fix,
    )


def check_shm() -> Check:
    """/dev/shm (shared memory for gloo and DataLoader workers) has >= 256 MiB free; only Linux has it."""
    if not os.path.isdir("/dev/shm"):  # macOS and Windows have none and need none; Linux does
        linux = sys.platform == "linux"
        return Check(
            "fail" if linux else "pass",
            f"no /dev/shm on {sys.platform}",
            "mount a tmpfs on /dev/shm (docker: --shm-size=1g)" if linux else "",
        )
    return free_space(
        "/dev/shm",
        MIN_SHM_MIB,
        "gloo and DataLoader workers",
        "close programs using it, or enlarge it (docker: --shm-size=1g)",
    )


def check_disk() -> Check:
    """The disk holding the repository has >= 2 GiB free for data and checkpoints."""
    return free_space(str(REPO), MIN_DISK_MIB, "data sets and checkpoints", f"free space on {REPO}")


def check_gpus() -> Check:
    """GPUs are optional. With GPUs, NCCL should be available (the scripts pick it by themselves), and with
    fewer GPUs than the notebooks' 2 ranks a launch runs on gloo (``environment.launch_backend``, as the
    launcher does)."""
    import torch
    import torch.distributed as dist

    from ddp_helpers.environment import launch_backend

    count = torch.cuda.device_count()
    if count == 0:
        return Check("pass", "no GPU: the notebooks use gloo on the CPU")
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(count))
    if not dist.is_nccl_available():
        return Check(
            "warn",
            f"{count} GPU(s) ({names}) but this torch has no NCCL, which the scripts pick "
            "when they see a GPU: their init_process_group fails",
            "install a CUDA build of torch on Linux, or run everything on the CPU: export DDP_BACKEND=gloo",
        )
    backend, _ = launch_backend(2, count)
    if backend == "gloo":
        return Check(
            "pass",
            f"{count} GPU ({names}), NCCL available: a launch of one rank per node uses "
            "NCCL; the notebooks' 2-rank launches run on gloo and the CPU (NCCL needs one GPU per rank)",
        )
    return Check("pass", f"{count} GPU(s) ({names}), NCCL available")


def _same_python(argv0: str) -> bool:
    """Whether a kernelspec's argv[0] runs this interpreter (jupyter_client swaps a bare ``python``)."""
    if argv0 in {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}:
        # that is the interpreter running Jupyter, not necessarily this one: see check_kernel's prefix check
        return False
    path = os.path.abspath(shutil.which(argv0) or argv0)
    # the same bin/ folder: the same environment
    return os.path.dirname(path) == os.path.dirname(os.path.abspath(sys.executable))


def check_kernel() -> Check:
    """A Jupyter kernel runs this environment's Python: its own ``python3`` kernel, or one pointing here."""
    from jupyter_client.kernelspec import KernelSpecManager

    manager = KernelSpecManager()
    specs = manager.find_kernel_specs()
    for name in specs:
        argv = manager.get_kernel_spec(name).argv
        if argv and _same_python(argv[0]):
            return Check("pass", f"kernel {name!r} runs {argv[0]}")
    own = Path(sys.prefix, "share", "jupyter", "kernels", "python3")
    if "python3" in specs and Path(specs["python3"]).resolve() == own.resolve():
        return Check("pass", f"kernel 'python3' in {own} (JupyterLab from this environment uses it)")
    return Check(
        "fail",
        f"no kernel runs {sys.executable} (found: {', '.join(specs) or 'none'})",
        f"{sys.executable} -m ipykernel install --user --name ddp-notebooks",
    )


def checks(timeout: float) -> list[tuple[str, Callable[[], Check]]]:
    """Every check, named, in the order printed (the one place a check's name is written); looked up at call
    time so that tests can replace one."""
    packages = [(p, lambda p=p: check_package(p)) for p in ("torch", "torchvision", "jupyterlab")]
    return [
        ("python", check_python),
        ("platform", check_platform),
        *packages,
        ("torch.distributed", check_distributed),
        ("network settings", check_network_settings),
        ("shell variables", check_stale_variables),
        ("loopback ports", check_loopback),
        ("2-rank all_reduce", lambda: check_job(timeout)),
        ("CPU cores", check_cores),
        ("shared memory", check_shm),
        ("disk space", check_disk),
        ("GPUs", check_gpus),
        ("Jupyter kernel", check_kernel),
    ]


def run_check(name: str, fn: Callable[[], Check]) -> Check:
    """Run one check and name what it returns; an exception becomes a failed check, never a traceback."""
    try:
        return replace(fn(), name=name)
    except Exception as e:  # one broken check must not hide the others
        return Check(
            "fail",
            f"the check itself raised {type(e).__name__}: {e}",
            "fix what the message names and rerun; report it if unclear",
            name=name,
        )


def line(c: Check) -> str:
    """One printed line (plus an indented fix line when not passing)."""
    return f"{MARK[c.status]} {c.name}: {c.detail}" + (
        f"\n    → {c.fix}" if c.fix and c.status != "pass" else ""
    )


def main(argv: list[str] | None = None) -> int:
    """Run every check, print one line each (or one JSON object); 0 if nothing failed, else 1."""
    parser = argparse.ArgumentParser(
        prog="python -m ddp_helpers.doctor",
        description="Is this machine ready for the workshop? One line per check.",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (for collecting a room's results)"
    )
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="limit for the 2-rank job, s (default 180)"
    )
    ns = parser.parse_args(argv)
    results = []
    try:
        for name, fn in checks(ns.timeout):
            results.append(run_check(name, fn))
            if not ns.json:
                print(line(results[-1]), flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    ok = all(c.status != "fail" for c in results)
    if ns.json:
        print(
            json.dumps(
                {
                    "ok": ok,
                    "checks": [asdict(c) for c in results],
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                    "hostname": socket.gethostname(),
                }
            )
        )
    else:
        failed = [c.name for c in results if c.status == "fail"]
        warned = sum(c.status == "warn" for c in results)
        print(
            f"\n{'READY' if ok else 'NOT READY: ' + ', '.join(failed)} ({len(results)} checks, "
            f"{len(failed)} failed, {warned} warning(s))"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
