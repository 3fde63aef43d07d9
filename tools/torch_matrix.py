"""Run the series on other torch releases: a cached environment per minor version, a table of what breaks.

    python tools/torch_matrix.py [2.M ...] [--floor] [--notebooks [--solutions]] [--only NN ...] [--check]
                                 [--warm-only] [--version-specific] [--keep-envs] [--save-sources]
                                 [--write-table] [--prepare]
    python tools/torch_matrix.py --table [--write-table]

Versions: the ones named, ``--floor`` (the floor pyproject.toml declares, ``torch>=2.M``), or by default
every minor release from the floor to the newest on the package index. Each gets its newest patch release that
has a matching torchvision (torch 2.M pairs with torchvision 0.(M+15), and pip checks torchvision's own pin on
torch); a release without one gets a row that says so. The pinned pair (constraints.txt) runs in this
interpreter's own environment where that has it, otherwise like the others.

For each version, an environment ``envs/torch-X-tvY/`` in the cache (``.cache/torch-matrix/`` in the clone,
or ``$TORCH_MATRIX_CACHE``) with torch and torchvision held to the pair, pip's download cache off (about
6.6 GB, CUDA libraries included: the package index has no CPU-only wheels of these releases); with
``--notebooks`` also the project, installed with ``pip install -e`` (so pip checks pyproject.toml's floor
too), and its other dependencies. Only the floor's environment stays on disk, unless ``--keep-envs``. Then,
in a fresh copy of the working tree (the files git tracks or does not ignore):

1. the scripts (unless ``--no-scripts``): every case of ``benchmarks/warm_fidelity.py`` (every Python script
   of notebooks/scripts), cold and warm, launched as the notebooks launch them; ``--warm-only``: warm only,
   once. A case passes when warm and cold agree and both report what the pinned version reports: records
   equal, floats within a relative FLOAT_RTOL; where only floats differ by more it says so; where torch
   itself behaves otherwise the difference must be one NAMED below, or it fails.
2. ``--notebooks``: each notebook under nbmake, one at a time; a failure is reported with its cell's index
   (0-based, markdown cells included, as in the .ipynb file) and its error's last line, a cell that does not
   answer within ``--cell-timeout`` as a hang. Cells tagged ``version-specific`` assert a behaviour that
   differs between versions (their text says which); a failure there is reported as such. Notebook 05's
   SLURM cells (section 7) run where the practice cluster of tools/slurm_cluster.sh answers, with the version
   under test; elsewhere they print one line and pass, and the table says they did not run.
3. ``--version-specific`` (CI's floor check adds it; not on the pinned version, which the test suite runs):
   every notebook that holds ``version-specific`` cells, where those cells must pass as every other: a
   version-specific cell asserts what the torch it runs on does, on each side, and never raises on a release
   the project declares; a learner's Run All stops at the first cell that raises. To fit CI's time, each runs
   the cells its version-specific cells need (``version_specific_slice``: by the names they read, the other
   code cells emptied); where that fails, every cell up to the last version-specific one runs, and that run's
   verdict counts. Needs the notebooks' environment, as ``--notebooks``.

Results: ``tools/torch-matrix-results/torch-2.M.json``, one ``Row`` each (its shape is written once, below,
under "what a run stores"), committed with the table they render (a rerun of some notebooks or scripts keeps
the rest; tests/test_torch_matrix.py checks that MEASURES.md's table is what they render); the table goes to
stdout and, with ``--write-table`` (or its old name ``--write-readme``), into MEASURES.md between
``<!-- torch-matrix -->`` and ``<!-- /torch-matrix -->``. ``--check`` (what CI runs, with ``--floor
--warm-only``) runs the pinned version's scripts as well, warm, as the reference, keeps its results in the
cache (``results/``), not with the table's, and exits 1 unless every case passes on every version run, and
every notebook ``--version-specific`` ran passes.
``--prepare`` only makes the environments (the pinned version needs none here), with the notebooks' when
``--notebooks`` or ``--version-specific`` says so; CI runs it beside the test suite, so that the floor check
after the suite finds its environment ready.

Why a script of our own and not nox: nox would make and reuse the environments (about 30 lines here), but not
pair torchvision with torch, limit a child's time, kill what a hung notebook leaves behind, remove 6 GB
environments or compare the versions' records, which is the rest of this file. Standard library only: the
children run in each environment's own Python. Every child runs at nice 10 in a session of its own, and this
process is their subreaper, so that nothing they start outlives them (a timeout kills the whole tree).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import datetime
import fcntl
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NotRequired, TypedDict

# The pins and the floor, read by the package's own parser: importing ddp_helpers imports nothing else (no
# torch), so that this runs with the system's python3 before any environment exists.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ddp_helpers.pins import read_dependencies, read_floors, read_pins, release

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "tools" / "torch-matrix-results"  # committed: MEASURES.md's table is rendered from these
MARKERS = ("<!-- torch-matrix -->", "<!-- /torch-matrix -->")
TABLE_PAGE = "MEASURES.md"  # the page whose torch-matrix table --write-table rewrites
TV_OFFSET = 15  # torch 2.M pairs with torchvision 0.(M+15): 2.4 with 0.19, 2.14 with 0.29
VERSION_SPECIFIC = "version-specific"  # the tag of a notebook cell that asserts what differs between versions
# rounding errors the scripts report (a max_abs_diff of 6e-6) vary by build
FLOAT_RTOL, FLOAT_ATOL = 1e-4, 1e-5
# the ports of 05_launch's connections: the OS picks new ones every launch
LAUNCH_NOISE = ["records[*].tcp_opened"]
OK = ("pass", "pass≈", "floats differ", "named")  # the script verdicts --check accepts

# Where torch itself behaves differently and the script runs all the same: (case, first and last minor
# version, the paths of the records that differ (a prefix; [*] for any index), what). Nothing else may.
NAMED = [
    (
        "04_ddp",
        (2, 8),
        (2, 12),
        ["records[*].broadcast_buffers=False", "records[*].forward_sync_buffers=False"],
        "DDP's forward_sync_buffers is new in torch 2.13: the script reports broadcast_buffers=False instead",
    ),
    (
        "09_training batchnorm",
        (2, 8),
        (2, 12),
        ["records[*].variant", "records[*].versions"],
        "DDP's forward_sync_buffers is new in torch 2.13: the script's variant turns off broadcast_buffers, "
        "which also leaves out the broadcast at construction (its version counters stay one lower)",
    ),
    (
        "09_training batchnorm",
        (2, 8),
        (2, 11),
        ["records[*].ok", "records[*].error", "records[*].versions", "records[*].checksums"],
        "before torch 2.12 (pytorch#175851) DDP's buffer broadcast bumps running_mean's version counter, so "
        "two forwards and one backward fail with autograd's in-place error (notebook 09 §4b); the version "
        "counters the script reports differ in its other variants too, their gradients do not",
    ),
]


# ---- what a run stores: tools/torch-matrix-results/torch-2.M.json holds one Row ----------------------------


class Pair(TypedDict):
    """A torch release and the torchvision pip pairs with it (``resolve``)."""

    minor: str  # "2.13"
    torch: str | None  # None: the index has no release of this minor version
    torchvision: str | None  # None: none pairs with it (``why`` says so), and nothing ran
    exclude: list[str]  # local builds (find-links' 2.13.0+cpu) that pip was told to leave out
    why: str


class Source(TypedDict):
    """The tree a part of a row was run from (``tree_source``)."""

    commit: str
    edited: bool  # it had uncommitted changes


class Outcome(TypedDict):
    """One launch of one case, as benchmarks/warm_fidelity.py reports it."""

    failed: bool
    records: NotRequired[list[dict[str, Any]]]
    exitcodes: NotRequired[dict[str, int]]  # by rank, of a launch that did not fail
    raised: NotRequired[list[str]]  # the exception of the rank blamed
    hung: NotRequired[bool]
    stuck: NotRequired[list[int]]
    error: NotRequired[str]  # the error's text: never compared (it names processes and ports)
    launcher_error: NotRequired[str]  # the launcher itself raised
    unfinished: NotRequired[bool]  # written here: the run's time ran out during this launch


class Case(TypedDict):
    """One case of warm_fidelity.CASES (``case_key``): its launches, and their seconds by "cold", "warm"."""

    seconds: dict[str, float]
    cold: NotRequired[Outcome]  # none in a --warm-only run
    warm: NotRequired[Outcome]


class ChildRun(TypedDict):
    """How a child process ended (``run_child``)."""

    rc: int | None  # None: killed when its time ran out
    timed_out: bool
    seconds: float
    leftovers: list[str]  # processes still running after it ended by itself, killed


class ScriptsRun(ChildRun):
    """One run of benchmarks/warm_fidelity.py (``run_scripts``): each case by its key."""

    warm_only: bool
    date: str
    only: str  # the scripts run, by the start of their names ("": all)
    cases: dict[str, Case]
    source: NotRequired[Source]


class NotebookVerdict(TypedDict):
    """What one nbmake run of one notebook says (``notebook_verdict``), and what the run adds."""

    status: str  # pass | version-specific | fail | hang | error
    cell: NotRequired[int | None]  # the cell that failed or did not answer (0-based, markdown cells counted)
    error: NotRequired[str]
    version_specific: NotRequired[bool]  # the failing cell is a version-specific one
    cells: NotRequired[list[int]]  # the version-specific cells that failed
    seconds: NotRequired[float]
    leftovers: NotRequired[list[str]]
    slice: NotRequired[NotebookVerdict]  # --version-specific: the slice's verdict, where it did not pass
    slurm_not_run: NotRequired[str]  # why notebook 05's SLURM cells submitted no jobs
    source: NotRequired[Source]


class NotebooksRun(TypedDict):
    """The notebooks one run ran (``run_notebooks``): each verdict by the notebook's path."""

    date: str
    cell_timeout: int
    results: dict[str, NotebookVerdict]
    cells: NotRequired[str]  # --version-specific: which cells ran


class Row(Pair):
    """One version's results: the pair, the last run's date and tree, what its scripts and notebooks did."""

    date: str
    source: Source
    scripts: NotRequired[ScriptsRun]
    notebooks: NotRequired[NotebooksRun]


@dataclass(frozen=True)
class Cache:
    """Where runs keep what they make: ``$TORCH_MATRIX_CACHE`` (CI keeps it per machine), or
    ``.cache/torch-matrix/`` in the clone."""

    root: Path

    @classmethod
    def from_environment(cls) -> Cache:
        return cls(Path(os.environ.get("TORCH_MATRIX_CACHE") or ROOT / ".cache" / "torch-matrix"))

    @property
    def envs(self) -> Path:
        """An environment per pair, and its constraints."""
        return self.root / "envs"

    @property
    def checks(self) -> Path:
        """The results of --check runs, kept apart from the committed ones."""
        return self.root / "results"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def src(self) -> Path:
        """The copy of the tree under test (``copy_worktree``)."""
        return self.root / "src"

    @property
    def sources(self) -> Path:
        """torch's Python files, by version (--save-sources)."""
        return self.root / "sources"


# ---- versions ----------------------------------------------------------------------------------------------


def minor_of(version: str) -> tuple[int, int]:
    """'2.13.0+cpu' -> (2, 13)."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def label(minor: tuple[int, int]) -> str:
    return f"{minor[0]}.{minor[1]}"


def declared_floor(pyproject: Path = ROOT / "pyproject.toml") -> tuple[int, int]:
    """The torch minor version pyproject.toml's ``torch>=2.M`` declares."""
    floor = read_floors(pyproject).get("torch")
    if floor is None:
        raise ValueError(f"{pyproject} declares no torch>=2.M")
    return minor_of(floor)


def pinned_pair() -> dict[str, str]:
    """The torch and torchvision constraints.txt pins: what the notebooks are run with."""
    pins = read_pins(ROOT / "constraints.txt")
    return {"torch": pins["torch"], "torchvision": pins["torchvision"]}


def _pip_env(cache: Cache, constraints: Path | None = None) -> dict[str, str]:
    """This machine's pip configuration (index, certificates, find-links), with our constraints in place of
    any configured ones (an environment variable overrides pip's configuration files), no download cache."""
    if constraints is None:
        constraints = cache.root / "no-constraints.txt"
        constraints.parent.mkdir(parents=True, exist_ok=True)
        constraints.write_text("")
    return dict(
        os.environ, PIP_CONSTRAINT=str(constraints), PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1"
    )


def index_versions(name: str, cache: Cache) -> list[str]:
    """The versions ``pip index versions NAME`` lists, newest first, local builds (``+cpu``) included."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", name],
        capture_output=True,
        text=True,
        env=_pip_env(cache),
        timeout=300,
        check=False,
    ).stdout
    for line in out.splitlines():
        if line.startswith("Available versions:"):
            return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    raise RuntimeError(f"pip lists no versions of {name}:\n{out}")


def newest_minor(versions: Sequence[str]) -> tuple[int, int]:
    return max(minor_of(v) for v in versions if "+" not in v)


def resolve(minor: tuple[int, int], torch_versions: Sequence[str], cache: Cache) -> Pair:
    """The pair pip picks for ``torch==2.M.*`` with ``torchvision==0.(M+15).*`` (metadata only, nothing
    installed), local builds such as find-links' 2.13.0+cpu left out."""
    exclude = [v for v in torch_versions if "+" in v and minor_of(v) == minor]
    pair: Pair = {"minor": label(minor), "torch": None, "torchvision": None, "exclude": exclude, "why": ""}
    constraints = cache.root / f"resolve-{label(minor)}.txt"
    constraints.parent.mkdir(parents=True, exist_ok=True)
    constraints.write_text("".join(f"torch!={v}\n" for v in exclude))
    tv = f"0.{minor[1] + TV_OFFSET}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            "-",
            f"torch=={label(minor)}.*",
            f"torchvision=={tv}.*",
        ],
        capture_output=True,
        text=True,
        env=_pip_env(cache, constraints),
        timeout=900,
        check=False,
    )
    if done.returncode:
        last = [ln for ln in done.stderr.splitlines() if ln.strip()][-1:] or ["pip failed"]
        newest = max(
            (v for v in torch_versions if "+" not in v and minor_of(v) == minor), key=release, default=None
        )
        return {
            **pair,
            "torch": newest,
            "why": f"no torchvision {tv}.x to pair with it (pip: {last[0].strip().removeprefix('ERROR: ')})",
        }
    found = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(done.stdout)["install"]
    }
    return {**pair, "torch": found["torch"], "torchvision": found["torchvision"]}


# ---- child processes: low priority, a session of their own, nothing outlives them --------------------------


def become_subreaper() -> None:
    """Orphans of our children (a Jupyter kernel and torchrun's agents start sessions of their own) re-parent
    to this process, not to init, so that they can be found and killed. Linux only; elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def descendants() -> list[int]:
    """Every live process below this one (zombies left out)."""
    # its own /proc parse: the package's is in its launch modules, which this tool never imports (only pins)
    kids: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != b"Z":
            kids.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [os.getpid()]
    while todo:
        for child in kids.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _describe(pid: int) -> str:
    try:
        return (
            f"{pid}: "
            + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
        )
    except OSError:
        return str(pid)


def kill_descendants() -> list[str]:
    """SIGKILL every process below this one (one child runs at a time); returns the ones killed, described."""
    killed: list[str] = []
    for _ in range(10):
        alive = descendants()
        if not alive:
            break
        for pid in alive:
            killed.append(_describe(pid))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
        _reap()
    return sorted(set(killed))


def run_child(
    cmd: Sequence[str | Path], *, log: Path, timeout: float, cwd: Path, env: Mapping[str, str]
) -> ChildRun:
    """Run ``cmd`` at nice 10 in its own session, its output to ``log``; when it ends or its time is up, kill
    whatever it left running: its leftovers are processes still alive 15 s after the child ended by itself (a
    launch's ranks end when their lifeline closes: a moment)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log, "wb") as out:
        out.write(f"$ {' '.join(map(str, cmd))}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            list(map(str, cmd)),
            cwd=cwd,
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=lambda: os.nice(10),
        )
        try:
            rc, timed_out = proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
        except BaseException:  # an interrupt: nothing of ours may go on running
            kill_descendants()
            raise
        deadline = time.monotonic() + (0 if timed_out else 15)
        while descendants() and time.monotonic() < deadline:
            _reap()
            time.sleep(0.5)
        leftovers = kill_descendants()
        if timed_out:
            out.write(f"\n[torch_matrix] killed after {timeout:g} s\n".encode())
    return {
        "rc": rc,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - start, 1),
        "leftovers": [] if timed_out else leftovers,
    }


# ---- environments and the copy of the series under test ----------------------------------------------------


class EnvInfo(TypedDict):
    """The environment a version runs in (``ensure_env``), and whether it was there already."""

    env: str
    reused: bool
    install_seconds: NotRequired[int]


def env_name(pair: Pair) -> str:
    return f"torch-{pair['torch']}-tv{pair['torchvision']}"


def own_python_has(pair: Pair) -> bool:
    """Whether this interpreter's environment has exactly ``pair`` (local builds such as +cu130 aside)."""
    code = "import torch, torchvision; print(torch.__version__, torchvision.__version__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=False)
    return [v.split("+")[0] for v in done.stdout.split()] == [pair["torch"], pair["torchvision"]]


def ensure_env(pair: Pair, cache: Cache, notebooks: bool = True) -> tuple[Path, EnvInfo]:
    """The Python of an environment with ``pair`` (made if missing), and what was done. For the scripts
    alone (``notebooks=False``, what CI's floor check runs) it gets torch and torchvision: the scripts import
    nothing else, and the children find ddp_helpers on PYTHONPATH. For the notebooks it also gets the project
    with ``pip install -e`` (so pip checks pyproject.toml's floor too) and the project's other dependencies,
    added to an environment made for the scripts; below the floor, where pip would refuse the project, the
    project goes in without its dependencies, and those by name (to see why a release is below the floor)."""
    path = cache.envs / env_name(pair)
    mark = path / "matrix-env.json"
    python = path / "bin" / "python"
    requirements = [f"torch=={pair['torch']}", f"torchvision=={pair['torchvision']}"]
    others = [r for r in read_dependencies(ROOT / "pyproject.toml") if not re.match(r"torch(vision)?\b", r)]
    have = json.loads(mark.read_text()).get("wanted", {}) if mark.exists() else {}
    if have.get("requirements") != requirements:
        have = {}
    if have and (not notebooks or have.get("others") == others):  # the floor may move without a new install
        return python, {"env": path.name, "reused": True}
    constraints = cache.envs / f"{path.name}.constraints.txt"
    constraints.parent.mkdir(parents=True, exist_ok=True)
    constraints.write_text("\n".join(requirements + [f"torch!={v}" for v in pair.get("exclude", [])]) + "\n")
    pip = [python, "-m", "pip", "install", "--quiet"]
    steps = []
    if not have:
        shutil.rmtree(path, ignore_errors=True)
        steps += [[sys.executable, "-m", "venv", path], [*pip, *requirements]]
    if notebooks:
        if minor_of(pair["torch"]) < declared_floor():
            steps += [[*pip, *others, "pytest", "pytest-timeout"], [*pip, "--no-deps", "-e", cache.src]]
        else:
            steps += [[*pip, "-e", cache.src, "pytest", "pytest-timeout"]]
    start = time.monotonic()
    for i, step in enumerate(steps):
        log = cache.logs / path.name / f"install.{i}.log"
        if run_child(step, log=log, timeout=3600, cwd=ROOT, env=_pip_env(cache, constraints))["rc"] != 0:
            shutil.rmtree(path, ignore_errors=True)
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"installing {path.name} failed; see {log}:\n{tail}")
    info: EnvInfo = {"env": path.name, "reused": False, "install_seconds": round(time.monotonic() - start)}
    wanted = {"requirements": requirements, "others": others if notebooks else have.get("others", [])}
    mark.write_text(json.dumps({"wanted": wanted, **info}, indent=1))
    return python, info


def copy_worktree(src: Path) -> Source:
    """A fresh copy of the series in ``src``: the files git tracks or would track, as they are on disk."""
    shutil.rmtree(src, ignore_errors=True)
    git = ["git", "-C", str(ROOT)]
    names = subprocess.run(
        git + ["ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in map(os.fsdecode, filter(None, names)):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    return tree_source()


def tree_source() -> Source:
    """The commit the working tree is at, and whether it has uncommitted changes (the results of earlier
    versions in this run, and the tables they go into, are not changes of the tree they were run from)."""
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    outputs = [f":!{RESULTS.relative_to(ROOT)}", f":!{TABLE_PAGE}"]
    dirty = subprocess.run(
        git + ["status", "--porcelain", "--", ".", *outputs], capture_output=True, text=True
    ).stdout.strip()
    return {"commit": commit, "edited": bool(dirty)}


def save_sources(python: Path, version: str, folder: Path) -> None:
    """Keep this version's torch/*.py in ``folder``/<version>/ (60 MB), to compare after the env is gone."""
    site = subprocess.run(
        [python, "-c", "import torch, os; print(os.path.dirname(torch.__file__))"],
        capture_output=True,
        text=True,
        cwd="/",
        check=True,
    ).stdout.strip()
    target = folder / version / "torch"
    if not target.exists():
        shutil.copytree(
            site,
            target,
            ignore=lambda d, names: [
                n for n in names if not n.endswith(".py") and not (Path(d) / n).is_dir()
            ],
        )


def child_env(python: Path, src: Path) -> dict[str, str]:
    """A child's environment: ``python``'s environment first on PATH (its jupyter and torchrun), the copy of
    the tree under test on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1")
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = f"{python.parent}:{env.get('PATH', '')}"
    return env


# ---- the scripts -------------------------------------------------------------------------------------------


def case_key(script: str, args: Sequence[str]) -> str:
    """A short name for one case of warm_fidelity.CASES: the script, and --case's value where given."""
    args = list(args)
    extra = f" {args[args.index('--case') + 1]}" if "--case" in args else ""
    return script.removesuffix(".py") + extra + (" --buggy" if "--buggy" in args else "")


def run_scripts(
    python: Path, src: Path, log_dir: Path, only: str, timeout: float, warm_only: bool = False
) -> ScriptsRun:
    """Every case of benchmarks/warm_fidelity.py (those whose script starts with ``only``) in ``src``, run by
    ``python``, its launches gathered by case."""
    events = log_dir / "scripts.jsonl"
    events.unlink(missing_ok=True)
    cmd = [python, "benchmarks/warm_fidelity.py", "--json", events] + ([only] if only else [])
    cmd += ["--warm-only"] if warm_only else []
    done = run_child(cmd, log=log_dir / "scripts.log", timeout=timeout, cwd=src, env=child_env(python, src))
    cases: dict[str, Case] = {}
    for line in events.read_text().splitlines() if events.exists() else []:
        event = json.loads(line)
        case = cases.setdefault(case_key(event["script"], event["args"]), {"seconds": {}})
        mode = "warm" if event["warm"] else "cold"
        case[mode], case["seconds"][mode] = event["outcome"], event["seconds"]
    if done["timed_out"]:  # the case that was running when time ran out, if any, is a hang
        for case in cases.values():
            case.setdefault("warm", {"failed": True, "unfinished": True})
    return {
        "warm_only": warm_only,
        "date": today(),
        "only": only,
        "rc": done["rc"],
        "timed_out": done["timed_out"],
        "seconds": done["seconds"],
        "leftovers": done["leftovers"],
        "cases": cases,
    }


def differences(a: Any, b: Any, path: str = "", rtol: float = FLOAT_RTOL) -> tuple[list[str], float]:
    """Where two outcomes differ beyond float rounding (paths such as records[3].loss), and the largest
    relative difference between two floats. Ints, strings and bools must be equal (True is not 1 here)."""
    if isinstance(a, dict) and isinstance(b, dict):
        parts = [
            ([f"{path}.{k}".lstrip(".")], 0.0)
            if k not in a or k not in b
            else differences(a[k], b[k], f"{path}.{k}", rtol)
            for k in sorted(set(a) | set(b), key=str)
        ]
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path.lstrip('.') or 'value'} (length {len(a)} vs {len(b)})"], 0.0
        parts = [differences(x, y, f"{path}[{i}]", rtol) for i, (x, y) in enumerate(zip(a, b, strict=True))]
    elif (
        isinstance(a, float)
        and isinstance(b, (int, float))
        and not isinstance(b, bool)
        or isinstance(b, float)
        and isinstance(a, int)
        and not isinstance(a, bool)
    ):
        if a == b or (math.isnan(a) and math.isnan(b)):
            return [], 0.0
        rel = abs(a - b) / max(abs(a), abs(b))
        return ([] if rel <= rtol or abs(a - b) <= FLOAT_ATOL else [path.lstrip(".")]), rel
    else:
        same = a == b and type(a) is type(b)
        return ([] if same else [path.lstrip(".") or "value"]), 0.0
    return [p for ps, _ in parts for p in ps], max((w for _, w in parts), default=0.0)


def _pattern(path: str) -> str:
    return re.sub(r"\[\d+\]", "[*]", path).split(" (length")[0]


def _covered(path: str, prefixes: Sequence[str]) -> bool:
    return any(_pattern(path) == p or _pattern(path).startswith((p + ".", p + "[")) for p in prefixes)


def _core(outcome: Outcome | None) -> dict[str, Any]:
    """What is compared: not the error's text, which names processes and ports; of a failed launch, the
    distinct records, whoever printed them (a rank stopped while its peer fails may not print its own)."""
    core = {k: v for k, v in (outcome or {}).items() if k not in ("error", "launcher_error")}
    if "raised" in core and outcome.get("error"):  # the blamed rank's exception only (older results: all)
        core["raised"] = re.findall(r"^(?:\w+: )?rank \d+ raised (\w+)", outcome["error"])[:1]
    if core.get("failed") and "records" in core:
        distinct = {
            json.dumps({k: v for k, v in r.items() if k != "rank"}, sort_keys=True) for r in core["records"]
        }
        core["records"] = [json.loads(r) for r in sorted(distinct)]
    return core


def error_line(outcome: Outcome) -> str:
    """How a launch failed, in one line: the blamed rank's exception (its traceback's last line) or a hang."""
    if outcome.get("unfinished"):
        return "the run's time ran out during this launch"
    if outcome.get("launcher_error"):
        return "launcher: " + outcome["launcher_error"].splitlines()[0][:200]
    lines = [ln.strip() for ln in outcome.get("error", "").splitlines() if ln.strip()]
    if not lines:
        return ""
    first = (
        lines[0]
        .removeprefix("JobHungError: ")
        .removeprefix("JobFailedError: ")
        .removeprefix("TorchrunError: ")
    )
    if outcome.get("hung") or len(lines) == 1:
        return first[:200]
    found = re.match(r"rank (\d+) raised ", first)
    return (f"rank {found[1]}: {lines[-1]}" if found else f"{first.rstrip('.:')}: {lines[-1]}")[:240]


def named_for(key: str, minor: tuple[int, int]) -> list[tuple[int, list[str], str]]:
    return [
        (i, paths, why)
        for i, (case, first, last, paths, why) in enumerate(NAMED, 1)
        if case == key and first <= minor <= last
    ]


def script_verdict(key: str, case: Case, reference: Case | None, minor: tuple[int, int]) -> tuple[str, str]:
    """(verdict, one-line detail) of one case on one version, against the pinned version's (None: this is the
    pinned row, compared warm against cold only). Verdicts: pass, pass≈, floats differ, named, differs, fails,
    hangs, warm≠cold, not run."""
    cold, warm = case.get("cold"), case.get("warm")  # a --warm-only run (and --check's reference) has no cold
    if warm is None:
        return "not run", ""
    if (cold or {}).get("unfinished") or warm.get("unfinished"):
        return "hangs", "the run's time ran out during this case"
    noise = LAUNCH_NOISE
    named = named_for(key, minor) if reference else []
    allowed = noise + [p for _, paths, _ in named for p in paths]
    worst, notes, verdict = 0.0, [], "pass"
    ref = reference and (reference.get("cold") or reference.get("warm"))
    for mine, theirs, what in ((cold or warm, ref, "ref"), (warm, cold, "cold")):
        if theirs is None:
            continue
        paths, rel = differences(_core(mine), _core(theirs))
        worst = max(worst, rel)
        paths = [p for p in paths if not _covered(p, noise)]
        if not paths:
            continue
        if what == "cold":
            return (
                "warm≠cold",
                f"warm differs from cold at {', '.join(paths[:4])}: {error_line(warm)}".rstrip(": "),
            )
        if all(_covered(p, allowed) for p in paths):
            verdict = "named"
            notes.append(" ".join(f"[N{i}]" for i, _, _ in named))
            continue
        if mine.get("failed") and not theirs.get("failed"):
            return ("hangs" if _core(mine).get("hung") else "fails"), error_line(mine)
        exact = [
            p for p in differences(_core(mine), _core(theirs), rtol=math.inf)[0] if not _covered(p, allowed)
        ]
        if exact:
            return "differs", f"differs from the pinned version at {', '.join(exact[:4])}" + (
                f" (+{len(exact) - 4} more)" if len(exact) > 4 else ""
            ) + (f": {error_line(mine)}" if mine.get("failed") else "")
        verdict = "floats differ"
        notes.append(
            f"floats differ by up to a relative {worst:.1e} at {', '.join(paths[:3])}"
            + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "")
        )
    if verdict == "pass" and worst:
        verdict, notes = "pass≈", [f"floats within a relative {worst:.1e}"]
    return verdict, "; ".join(notes)


# ---- the notebooks -----------------------------------------------------------------------------------------


def notebook_paths(src: Path, solutions: bool, only: Sequence[str]) -> list[str]:
    paths = sorted(p.relative_to(src).as_posix() for p in (src / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if solutions:
        paths += sorted(p.relative_to(src).as_posix() for p in (src / "notebooks/solutions").glob("*.ipynb"))
    return [p for p in paths if not only or any(Path(p).name.startswith(o) for o in only)]


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)


def let_version_specific_cells_fail(text: str) -> str:
    """A notebook's JSON with its version-specific cells also tagged ``raises-exception`` (nbclient's tag):
    nbmake records such a cell's error and runs on, so one run shows every cell that fails, not the first."""
    nb = json.loads(text)
    for cell in nb.get("cells", []):
        tags = cell.get("metadata", {}).get("tags", [])
        if VERSION_SPECIFIC in tags and "raises-exception" not in tags:
            tags.append("raises-exception")
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def up_to_last_version_specific_cell(text: str) -> str:
    """A notebook's JSON without the cells after its last version-specific cell (``--version-specific``): the
    cells it needs come before it; its version-specific cells are not let fail."""
    nb = json.loads(text)
    tagged = [i for i, c in enumerate(nb.get("cells", [])) if VERSION_SPECIFIC in _tags(c)]
    if tagged:
        nb["cells"] = nb["cells"][: tagged[-1] + 1]
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def _tags(cell: Mapping[str, Any]) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def _source(cell: Mapping[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _names(source: str) -> tuple[set[str], set[str], bool] | None:
    """What a code cell binds, what it reads that it does not bind itself, and whether it must run in any
    case (it changes the folder or loads or starts something: os.chdir, %load_ext, %ranks start, and every
    %%writefile); None where its Python cannot be read (then the whole notebook runs)."""
    if source.startswith("%%"):  # a cell magic: what it does is not the kernel's Python
        return set(), set(), source.startswith("%%writefile")
    lines = [re.sub(r"^(\s*)[%!].*", r"\1pass", line) for line in source.split("\n")]  # line magics, !cmd
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return None
    binds, reads, changes = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (binds if isinstance(node.ctx, (ast.Store, ast.Del)) else reads).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            binds.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            binds.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            binds.add(node.name)
        elif isinstance(node, ast.arg):
            binds.add(node.arg)
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            base = node
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name):
                changes.add(base.id)  # x[k] = ...: reads x, and a later cell that reads x needs this one
    must = bool(re.search(r"os\.chdir|^\s*%load_ext|^\s*%ranks start", source, re.M))
    return binds | changes, reads - (binds - changes) - set(dir(builtins)), must


def version_specific_slice(text: str) -> str:
    """A notebook's JSON as ``up_to_last_version_specific_cell`` makes it, with the code cells that no
    version-specific cell needs emptied (nbclient skips an empty cell; the indices stay the file's): a cell is
    needed when it runs in any case (``_names``) or binds a name that a needed cell reads (the last to bind
    it before). Where a cell cannot be read, or a version-specific cell is a %%ranks cell (the ranks hold
    their own state), every cell up to the last runs."""
    nb = json.loads(up_to_last_version_specific_cell(text))
    cells = nb.get("cells", [])
    code = {i: _source(c) for i, c in enumerate(cells) if c.get("cell_type") == "code"}
    tagged = [i for i, c in enumerate(cells) if VERSION_SPECIFIC in _tags(c)]
    names = {i: _names(source) for i, source in code.items()}
    if not tagged or any(v is None for v in names.values()) or any(code[i].startswith("%%") for i in tagged):
        return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    needed, todo = set(tagged), list(tagged)
    while todo:
        i = todo.pop()
        reads = set(names[i][1])
        if "_" in reads:  # IPython's last result: the cell before
            earlier = [j for j in code if j < i]
            reads.discard("_")
            if earlier and earlier[-1] not in needed:
                needed.add(earlier[-1])
                todo.append(earlier[-1])
        for name in reads:
            binder = next((j for j in sorted(code, reverse=True) if j < i and name in names[j][0]), None)
            if binder is not None and binder not in needed:
                needed.add(binder)
                todo.append(binder)
    needed |= {i for i in code if names[i][2]}
    for i in code:
        if i not in needed:
            cells[i]["source"] = ""
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def version_specific_paths(src: Path, only: Sequence[str]) -> list[str]:
    """The notebooks (not solutions, nor the translations: their code cells are the English ones) that hold a
    version-specific cell."""
    paths = notebook_paths(src, False, only)
    return [
        p
        for p in paths
        if any(VERSION_SPECIFIC in _tags(c) for c in json.loads((src / p).read_text())["cells"])
    ]


def _error_of(output: Mapping[str, Any]) -> tuple[str, bool]:
    """One line for an error output of a cell, and whether it was a hang."""
    lines = [ln.strip() for ln in _plain(str(output.get("evalue", ""))).splitlines() if ln.strip()] or [""]
    hang = output.get("ename") == "JobHungError" or bool(re.match(r"(timed out after|stalled)", lines[0]))
    if output.get("ename", "").endswith(("TorchrunError", "JobFailedError", "JobHungError")):
        return error_line({"failed": True, "error": "\n".join(lines), "hung": hang})[:300], hang
    return f"{output.get('ename', '')}: {lines[-1]}".rstrip(": ")[:300], hang


def notebook_verdict(done: ChildRun, log_text: str, nb: Mapping[str, Any] | None) -> NotebookVerdict:
    """What one nbmake run of one notebook says; ``nb``: the executed notebook (None if nbmake wrote none).
    Version-specific cells run on when they fail (``let_version_specific_cells_fail``): a notebook whose only
    failures are there is "version-specific", with those cells; any other failing cell is the verdict."""
    cells = (nb or {}).get("cells", [])
    unanswered = next(
        (
            i
            for i, c in enumerate(cells)
            if c.get("cell_type") == "code"
            and "shell.execute_reply" not in c.get("metadata", {}).get("execution", {})
        ),
        None,
    )
    errors = {  # cell index -> (its error's line, a hang?, version-specific?)
        i: (*_error_of(out), VERSION_SPECIFIC in c.get("metadata", {}).get("tags", []))
        for i, c in enumerate(cells)
        if c.get("cell_type") == "code"
        for out in c.get("outputs", [])
        if out.get("output_type") == "error"
    }
    listed = sorted(i for i, (_, _, tagged) in errors.items() if tagged)
    extra = {"cells": listed} if listed else {}
    timed_out = ("CellTimeoutError", "A cell timed out while it was being executed")  # nbmake's words for it
    if done["timed_out"] or any(words in log_text for words in timed_out):
        limit = re.search(r"after (\d+) seconds", log_text)
        why = (
            f"no answer within {limit[1]} s" if limit and not done["timed_out"] else "the run's time ran out"
        )
        return {"status": "hang", "cell": unanswered, "error": why, **extra}
    if done["rc"] == 0:
        if not listed:
            return {"status": "pass"}
        text = "; ".join(f"cell {i}: {errors[i][0]}" for i in listed)
        return {"status": "version-specific", "cell": listed[0], "error": text[:600], **extra}
    if errors:  # the run stopped at the last cell that failed: the cells tagged before it ran on
        i = max(errors)
        line, hang, tagged = errors[i]
        verdict = {"status": "hang" if hang else "fail", "cell": i, "error": line, "version_specific": tagged}
        return {**verdict, **extra}
    tail = [ln for ln in _plain(log_text).splitlines() if ln.strip()][-2:]
    return {"status": "error", "cell": None, "error": " / ".join(tail)[-240:], **extra}


def slurm_missing(python: Path, src: Path) -> str | None:
    """Why notebook 05's SLURM cells (section 7) will submit no jobs in this run, in the line they print
    (``practice_cluster_missing``, asked in the version's own environment), or None: they run, on the
    practice cluster of tools/slurm_cluster.sh, with this version (the jobs run the kernel's Python)."""
    code = "from ddp_helpers.slurm import practice_cluster_missing as m; print(m() or '')"
    done = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, cwd=src, env=child_env(python, src), check=False
    )
    if done.returncode:
        return f"not known: {done.stderr.strip()[-200:]}"
    return done.stdout.strip() or None


def uses_slurm(notebook: Path) -> bool:
    return "practice_cluster_missing" in notebook.read_text()


def run_notebooks(
    python: Path,
    src: Path,
    log_dir: Path,
    paths: Sequence[str],
    cell_timeout: int,
    limit: float,
    version_specific: bool = False,
) -> NotebooksRun:
    """Each notebook under nbmake, one at a time: whole, its version-specific cells let fail; or (
    ``version_specific``) the cells its version-specific cells need (``version_specific_slice``), where those
    must pass, and where that fails, every cell up to the last version-specific one, whose verdict counts (a
    slice that missed a cell's side effect costs time, never a false failure)."""
    results: dict[str, NotebookVerdict] = {}
    slurm = slurm_missing(python, src) if any(uses_slurm(src / rel) for rel in paths) else None
    for rel in paths:
        if not version_specific:
            verdict = _run_notebook(
                python, src, log_dir, rel, let_version_specific_cells_fail, cell_timeout, limit
            )
        else:
            verdict = _run_notebook(python, src, log_dir, rel, version_specific_slice, cell_timeout, limit)
            if verdict["status"] != "pass":
                sliced = {k: verdict[k] for k in ("status", "cell", "error", "seconds") if k in verdict}
                verdict = _run_notebook(
                    python, src, log_dir, rel, up_to_last_version_specific_cell, cell_timeout, limit
                )
                verdict["slice"] = sliced
        if slurm and uses_slurm(src / rel):  # the SLURM cells printed this line and passed
            verdict["slurm_not_run"] = slurm
        results[rel] = verdict
        print(
            f"    {rel}: {verdict['status']}"
            + (
                f": {verdict['error']}"  # it names each cell
                if verdict["status"] == "version-specific"
                else f" in cell {verdict.get('cell')}: {verdict.get('error')}"
                if verdict["status"] != "pass"
                else ""
            )
            + f" ({verdict['seconds']:.0f} s"
            + (
                f"; the slice: {verdict['slice']['status']}, {verdict['slice']['seconds']:.0f} s"
                if "slice" in verdict
                else ""
            )
            + ")",
            flush=True,
        )
    cut = {"cells": "those the version-specific cells need"} if version_specific else {}
    return {"date": today(), "cell_timeout": cell_timeout, "results": results, **cut}


def _run_notebook(
    python: Path,
    src: Path,
    log_dir: Path,
    rel: str,
    prepare: Callable[[str], str],
    cell_timeout: int,
    limit: float,
) -> NotebookVerdict:
    """One nbmake run of ``prepare``(the notebook), in ``src``; the file is restored after."""
    log = log_dir / "notebooks" / f"{Path(rel).stem}.log"
    cmd = [
        python,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-o",
        "timeout=0",
        "--nbmake",
        f"--nbmake-timeout={cell_timeout}",
        "--overwrite",
        rel,
    ]
    before = (src / rel).read_text()
    (src / rel).write_text(prepare(before))
    try:
        done = run_child(cmd, log=log, timeout=limit, cwd=src, env=child_env(python, src))
        after = (src / rel).read_text()
        executed = json.loads(after) if after != prepare(before) else None
        if executed is not None:
            shutil.copy2(src / rel, log.with_suffix(".ipynb"))
    finally:
        # the next notebook (a solutions notebook reads its own) sees the original
        (src / rel).write_text(before)
    verdict: NotebookVerdict = {
        **notebook_verdict(done, log.read_text(errors="replace"), executed),
        "seconds": done["seconds"],
    }
    if done["leftovers"]:
        verdict["leftovers"] = done["leftovers"]
    return verdict


# ---- results and the table ---------------------------------------------------------------------------------


def today() -> str:
    return datetime.date.today().isoformat()


def store(result: Row, folder: Path = RESULTS) -> Path:
    """Write one version's result, keeping what an earlier run of the same pair had and this one did not."""
    path = folder / f"torch-{result['minor']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = json.loads(path.read_text()) if path.exists() else {}
    if (merged.get("torch"), merged.get("torchvision")) != (result.get("torch"), result.get("torchvision")):
        merged = {}
    for key, value in result.items():
        old = merged.get(key)
        if key == "notebooks" and old:
            value = {**value, "results": {**old["results"], **value["results"]}}
        if key == "scripts" and old and value.get("only"):
            value = {**value, "cases": {**old["cases"], **value["cases"]}}
        merged[key] = value
    path.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    return path


def load_results(folder: Path = RESULTS) -> list[Row]:
    """Every version's stored result, the oldest first."""
    rows = [json.loads(p.read_text()) for p in folder.glob("torch-*.json")] if folder.is_dir() else []
    return sorted(rows, key=lambda r: minor_of(r["minor"]))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# A column per notebook of the series (and one per solutions notebook that was run).
_SERIES = [p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")]


def _notebook_column(rel: str) -> str:
    """A notebook's column: its number, and its first word where two notebooks share the number (the 00s)."""
    name = Path(rel).name
    shared = sum(other[:2] == name[:2] for other in _SERIES) > 1
    return (
        name[:2]
        + (f" {Path(name).stem[3:].split('_')[0]}" if shared else "")
        + (" sol." if "/solutions/" in rel else "")
    )


NOTEBOOK_COLUMNS = sorted(map(_notebook_column, _SERIES))


def check_failures(rows: Sequence[Row], pinned: Mapping[str, str]) -> list[str]:
    """Every script case on every row that is not one of OK: what --check fails on."""
    reference = next((r for r in rows if r.get("torch") == pinned["torch"]), None)
    ref_cases = (reference or {}).get("scripts", {}).get("cases", {})
    bad = []
    for row in rows:
        is_ref = row is reference
        for key, case in (row.get("scripts") or {}).get("cases", {}).items():
            if not is_ref and key not in ref_cases:
                bad.append(f"{row['torch']} {key}: no pinned run to compare with")
                continue
            verdict, detail = script_verdict(
                key, case, None if is_ref else ref_cases[key], minor_of(row["minor"])
            )
            if verdict not in OK:
                bad.append(f"{row['torch']} {key}: {verdict} ({detail})")
    return bad


def notebook_failures(results: Sequence[Row]) -> list[str]:
    """Every notebook a --check run ran (``results``: its versions' results) whose verdict is not a pass."""
    return [
        f"{row['torch']} {rel}: {v['status']} in cell {v.get('cell')}: {v.get('error')}"
        for row in results
        for rel, v in sorted((row.get("notebooks") or {}).get("results", {}).items())
        if v["status"] != "pass"
    ]


def _tree(source: Source | None) -> str:
    """The commit a run copied, short, with + where the working tree had uncommitted changes."""
    if not (source or {}).get("commit"):
        return "?"
    return source["commit"][:7] + ("+" if source.get("edited") else "")


def tree_cell(row: Row) -> str:
    """Which tree each part of a row was run from: one commit, or each with the parts it ran ("?" for a part
    stored without one); a row with no parts, the tree of its last run."""
    own: list[ScriptsRun | NotebookVerdict] = [row["scripts"]] if row.get("scripts") else []
    own += [v for _, v in sorted((row.get("notebooks") or {}).get("results", {}).items())]
    names = ["scripts"] * bool(row.get("scripts"))
    names += [_notebook_column(rel) for rel in sorted((row.get("notebooks") or {}).get("results", {}))]
    if not own:
        return _tree(row.get("source"))
    parts: dict[str, list[str]] = {}
    for name, part in zip(names, own, strict=True):
        parts.setdefault(_tree(part.get("source")), []).append(name)
    if len(parts) == 1:
        return next(iter(parts))
    return "; ".join(f"{tree}: {', '.join(names)}" for tree, names in parts.items())


def render_table(rows: Sequence[Row], pinned: Mapping[str, str]) -> str:
    """One row per torch minor version, the version first: torchvision, date, the tree it was run from, the
    scripts, each notebook."""
    reference = next((r for r in rows if r.get("torch") == pinned["torch"] and r.get("scripts")), None)
    ref_cases = (reference or {}).get("scripts", {}).get("cases", {})
    notes: list[str] = []

    def note(text: str) -> str:
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]"

    ran = {_notebook_column(rel) for r in rows for rel in (r.get("notebooks") or {}).get("results", {})}
    columns = NOTEBOOK_COLUMNS + sorted(ran - set(NOTEBOOK_COLUMNS))
    lines = [
        "| torch | torchvision | date | tree | scripts | " + " | ".join(columns) + " |",
        "|---" * (5 + len(columns)) + "|",
    ]
    used_named: set[int] = set()
    for row in rows:
        version = (row.get("torch") or row["minor"]) + (
            " (pinned)" if row.get("torch") == pinned["torch"] else ""
        )
        dates = sorted({part["date"] for part in (row.get("scripts"), row.get("notebooks")) if part})
        if row.get("torchvision") is None:
            lines.append(
                f"| {version} | none | {row.get('date', '')} | {_tree(row.get('source'))} | "
                f"not run: {_cell(row.get('why', ''))} |" + " |" * len(columns)
            )
            continue
        cases = (row.get("scripts") or {}).get("cases", {})
        passed, remarks = 0, []
        for key, case in cases.items():
            verdict, detail = script_verdict(
                key, case, None if row is reference else ref_cases.get(key), minor_of(row["minor"])
            )
            if row is not reference and key not in ref_cases:
                verdict, detail = "not compared", "no pinned run of this case"
            passed += verdict in OK
            if verdict == "named":
                used_named |= {int(n) for n in re.findall(r"\[N(\d+)\]", detail)}
                remarks.append(f"`{key}` {detail}")
            elif verdict not in ("pass", "pass≈"):
                remarks.append(f"`{key}` {verdict} " + note(f"{row['torch']}, {key}: {detail}"))
        scripts = (
            f"{passed}/{len(cases)}" + (f": {', '.join(remarks)}" if remarks else "") if cases else "not run"
        )
        nbs = (row.get("notebooks") or {}).get("results", {})
        by_column = {_notebook_column(rel): v for rel, v in nbs.items()}
        cells = []
        for column in columns:
            v = by_column.get(column)
            if v is None:
                cells.append("not run")
            elif v["status"] == "pass":
                skipped = v.get("slurm_not_run")
                why = f"{row['torch']}, {column}: the SLURM cells did not submit jobs: {skipped}"
                cells.append("pass, SLURM cells not run " + note(why) if skipped else "pass")
            elif v["status"] == "version-specific":
                listed = v.get("cells") or [v["cell"]]
                where = f"cell{'s' * (len(listed) > 1)} {', '.join(map(str, listed))}"
                why = f"{row['torch']}, {column}: {v['error']}"
                cells.append(f"version-specific in {where} " + note(why))
            else:
                what = {"fail": "fails", "hang": "hangs", "error": "error"}[v["status"]]
                # a version-specific cell stopped the run (--version-specific does not let them fail)
                if v.get("version_specific"):
                    what = "version-specific"
                where = f" in cell {v['cell']}" if v.get("cell") is not None else ""
                cells.append(f"{what}{where} " + note(f"{row['torch']}, {column}: {v.get('error', '')}"))
        lines.append(
            f"| {version} | {row['torchvision']} | {', '.join(dates)} | {_cell(tree_cell(row))} | "
            f"{_cell(scripts)} | " + " | ".join(_cell(c) for c in cells) + " |"
        )
    legend = [
        f"[N{i}] `{case}`, torch {label(first)} to {label(last)}: {why}."
        for i, (case, first, last, _, why) in enumerate(NAMED, 1)
        if i in used_named
    ]
    text = "\n".join(lines) + "\n"
    if legend or notes:
        text += (
            "\n"
            + "\n".join(
                [*(f"- {_cell(n)}" for n in legend), *(f"{i}. {_cell(n)}" for i, n in enumerate(notes, 1))]
            )
            + "\n"
        )
    return text


def replace_between_markers(text: str, block: str) -> str:
    """``text`` with what lies between the two marker lines replaced by ``block`` (the markers stay)."""
    start, end = MARKERS
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"no {start} ... {end} pair to write the table between")
    return text[: i + len(start)] + "\n" + block.rstrip("\n") + "\n" + text[j:]


# ---- the command -------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None, cache: Cache) -> argparse.Namespace:
    """The command line the module docstring shows."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "versions", nargs="*", metavar="2.M", help="torch minor versions (default: floor to newest)"
    )
    parser.add_argument("--floor", action="store_true", help="the floor pyproject.toml declares")
    parser.add_argument("--notebooks", action="store_true", help="the notebooks too, under nbmake")
    parser.add_argument("--no-scripts", action="store_true", help="with --notebooks: the notebooks only")
    parser.add_argument(
        "--solutions", action="store_true", help="with --notebooks: the solutions notebooks too"
    )
    parser.add_argument(
        "--only", nargs="+", default=[], metavar="NN", help="notebooks (one: scripts) named so"
    )
    parser.add_argument(
        "--check", action="store_true", help="also run the pinned scripts; exit 1 on a failure"
    )
    parser.add_argument(
        "--keep-envs", action="store_true", help="keep every environment (default: the floor's)"
    )
    parser.add_argument(
        "--warm-only",
        action="store_true",
        help="each case launched once, warm, as the notebooks launch it (CI's floor check), not also cold",
    )
    parser.add_argument(
        "--version-specific",
        action="store_true",
        help="the notebooks with version-specific cells, up to the last, which must pass (not on the pinned)",
    )
    parser.add_argument("--save-sources", action="store_true", help=f"keep torch/*.py under {cache.sources}")
    parser.add_argument("--cell-timeout", type=int, default=300, help="seconds a notebook cell may take")
    parser.add_argument("--notebook-timeout", type=float, default=1800, help="seconds a notebook may take")
    parser.add_argument("--scripts-timeout", type=float, default=3600, help="seconds all scripts may take")
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="only make (or find) each version's environment for the scripts; run nothing (CI, beforehand)",
    )
    parser.add_argument("--table", action="store_true", help="only show (and write) the stored results")
    parser.add_argument(
        "--write-table", "--write-readme", action="store_true", help=f"write the table into {TABLE_PAGE}"
    )
    return parser.parse_args(argv)


def choose_minors(
    args: argparse.Namespace, torches: Sequence[str], floor: tuple[int, int], pinned: Mapping[str, str]
) -> list[tuple[int, int]]:
    """The minor versions to run: those named, the floor, or every one from the floor to the newest the
    index has (``torches``); with --check the pinned one first, the reference, from the same tree."""
    if args.floor:
        minors = [floor]
    elif args.versions:
        minors = [minor_of(v) for v in args.versions]
    else:
        newest = newest_minor(torches)
        minors = [(2, m) for m in range(floor[1], newest[1] + 1)] if newest[0] == 2 == floor[0] else [newest]
    if args.check and minor_of(pinned["torch"]) not in minors:
        minors.insert(0, minor_of(pinned["torch"]))
    return minors


def results_folder(check: bool, cache: Cache) -> Path:
    """Where a run stores its results: a check's in the cache, so that it leaves the committed table alone."""
    return cache.checks if check else RESULTS


def pair_for(minor: tuple[int, int], torches: Sequence[str], pinned: Mapping[str, str], cache: Cache) -> Pair:
    """The pinned pair for the pinned minor version; for any other, the pair pip picks (``resolve``)."""
    if minor != minor_of(pinned["torch"]):
        return resolve(minor, torches, cache)
    return {
        "minor": label(minor),
        "torch": pinned["torch"],
        "torchvision": pinned["torchvision"],
        "exclude": [],
        "why": "",
    }


def prepare_env(pair: Pair, args: argparse.Namespace, cache: Cache) -> None:
    """--prepare: make (or find) the environment ``pair`` will run in, with the notebooks' where they run."""
    notebooks = args.notebooks or args.version_specific
    if notebooks:
        copy_worktree(cache.src)  # the project, installed from the copy the notebooks will run in
    _, info = ensure_env(pair, cache, notebooks=notebooks)
    how = "reused" if info["reused"] else f"installed in {info['install_seconds']} s"
    print(f"  {pair['minor']}: environment {info['env']}: {how}", flush=True)


def run_version(
    pair: Pair, args: argparse.Namespace, pinned: Mapping[str, str], cache: Cache, folder: Path
) -> Row:
    """Run one version: its scripts, its notebooks; store the result in ``folder`` and return it."""
    print(f"  {pair['minor']}: torch {pair['torch']} + torchvision {pair['torchvision']}", flush=True)
    source = copy_worktree(cache.src)
    is_pinned = pair["torch"] == pinned["torch"]
    if is_pinned and own_python_has(pair):
        python, info = Path(sys.executable), EnvInfo(env="this interpreter's", reused=True)
    else:
        python, info = ensure_env(pair, cache, notebooks=args.notebooks or args.version_specific)
    print(
        f"    environment {info['env']}: "
        + ("reused" if info["reused"] else f"installed in {info['install_seconds']} s"),
        flush=True,
    )
    if args.save_sources:
        save_sources(python, pair["torch"], cache.sources)
    log_dir = cache.logs / env_name(pair)
    result: Row = {**pair, "date": today(), "source": source}
    if not args.no_scripts:
        only = args.only[0] if len(args.only) == 1 else ""
        # --check's reference: the pinned version's own warm and cold agree in every full run (and
        # benchmarks/warm_fidelity.py checks it), so one launch, warm, is what the others are compared with.
        warm_only = args.warm_only or (args.check and is_pinned)
        s = result["scripts"] = run_scripts(python, cache.src, log_dir, only, args.scripts_timeout, warm_only)
        s["source"] = source
        ran_out = " (time ran out)" if s["timed_out"] else ""
        print(f"    scripts: {len(s['cases'])} cases in {s['seconds']:.0f} s{ran_out}", flush=True)
    if args.notebooks or (args.version_specific and not is_pinned):
        result["notebooks"] = run_notebooks(
            python,
            cache.src,
            log_dir,
            notebook_paths(cache.src, args.solutions, args.only)
            if args.notebooks
            else version_specific_paths(cache.src, args.only),
            args.cell_timeout,
            args.notebook_timeout,
            version_specific=not args.notebooks,
        )
        for verdict in result["notebooks"]["results"].values():
            verdict["source"] = source  # kept with each notebook: a later run of others keeps this one
    store(result, folder)
    keep = minor_of(pair["torch"]) == declared_floor() or args.keep_envs
    if not keep and python.parent.parent.parent == cache.envs:
        shutil.rmtree(python.parent.parent, ignore_errors=True)
    return result


def run(
    minors: Sequence[tuple[int, int]],
    torches: Sequence[str],
    args: argparse.Namespace,
    pinned: Mapping[str, str],
    cache: Cache,
) -> list[Row]:
    """Run each version in turn, storing each result as it comes (with --prepare only make the environments):
    the rows this run stored."""
    folder = results_folder(args.check, cache)
    rows: list[Row] = []
    for minor in minors:
        pair = pair_for(minor, torches, pinned, cache)
        if args.prepare:
            if pair["torchvision"] is not None and pair["torch"] != pinned["torch"]:
                prepare_env(pair, args, cache)
        elif pair["torchvision"] is None:
            print(f"  {pair['minor']}: {pair['why']}", flush=True)
            rows.append({**pair, "date": today(), "source": tree_source()})
            store(rows[-1], folder)
        else:
            rows.append(run_version(pair, args, pinned, cache, folder))
    return rows


def report(
    rows: Sequence[Row], fresh: Sequence[Row], args: argparse.Namespace, pinned: Mapping[str, str]
) -> int:
    """Show the table of the stored ``rows`` (with --write-table, write it into TABLE_PAGE); with --check, 1
    unless every case of the versions this run ran (``fresh``) passed, and every notebook it ran."""
    table = render_table(rows, pinned)
    print(table)
    if args.write_table:
        (ROOT / TABLE_PAGE).write_text(replace_between_markers((ROOT / TABLE_PAGE).read_text(), table))
        print(f"torch_matrix: wrote the table into {TABLE_PAGE}")
    if not args.check:
        return 0
    ran = {row["minor"] for row in fresh}
    bad = check_failures([r for r in rows if r["minor"] in ran], pinned) + notebook_failures(fresh)
    print(
        "\n".join(["torch_matrix --check: failed:", *bad])
        if bad
        else "torch_matrix --check: every case passed"
    )
    return 1 if bad else 0


def hold_cache_lock(cache: Cache) -> IO[str] | None:
    """An exclusive lock on the cache, held until this process ends, or None when another run holds it: two
    runs at once would each replace the copy of the tree (``cache.src``) the other is running from."""
    cache.root.mkdir(parents=True, exist_ok=True)
    # kept open for the life of the process
    lock = open(cache.root / "lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # run_child kills whatever is running on the way out


def main(argv: Sequence[str] | None = None) -> int:
    """Choose the versions, run them, report (the module docstring says how each step goes)."""
    cache = Cache.from_environment()
    args = parse_args(argv, cache)
    pinned = pinned_pair()
    fresh: list[Row] = []
    if not args.table:
        lock = hold_cache_lock(cache)
        if lock is None:
            print(
                f"torch_matrix: another run uses {cache.root} (its copy of the tree, {cache.src}); "
                "wait for it to end"
            )
            return 2
        become_subreaper()
        signal.signal(signal.SIGTERM, _interrupted)
        torches = index_versions("torch", cache)
        minors = choose_minors(args, torches, declared_floor(), pinned)
        print(f"torch_matrix: {', '.join(map(label, minors))}", flush=True)
        fresh = run(minors, torches, args, pinned, cache)
    if args.prepare:
        return 0
    floor = declared_floor()
    rows = [r for r in load_results(results_folder(args.check, cache)) if minor_of(r["minor"]) >= floor]
    return report(rows, fresh, args, pinned)  # rows older than the floor are not shown


if __name__ == "__main__":
    sys.exit(main())
