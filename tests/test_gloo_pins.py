"""Evidence only gloo gives comes from a launch pinned to gloo (issue 31 §2).

On a machine with one GPU per rank the scripts, the launcher and ``%ranks start`` pick NCCL, where a lone
collective returns at once, ``recv`` returns before the data arrives, and gloo's error texts never appear.
Two checks find a demonstration that forgot to pin gloo:

- at run time, strict mode (``ddp_helpers/_strict.py``; the root conftest.py turns it on while nbmake runs a
  notebook): a launch or ``%%ranks`` cell that ends as a hang, or with a rank gloo aborted, fails its cell
  unless it pinned gloo. Tested here on real launches and rank groups, with the variable set by hand.
- statically, below, over every code cell of every notebook (English, Chinese, solutions), what strict mode
  cannot see: an ``assert`` on one of gloo's own error texts, and point-to-point calls (``send``, ``recv``,
  ``isend``, ``irecv``) in a ``%%ranks`` cell, whose order and waits the cell shows as gloo's. Each needs
  the launch that produced it (the last one before it in the notebook) pinned: ``backend="gloo"``,
  ``env={"DDP_BACKEND": "gloo"}``, ``%ranks start ... --backend gloo``, or a script that never names NCCL. A
  cell that compares a backend with "gloo" or "nccl" asserts for each backend and is left alone.
"""

from __future__ import annotations

import ast
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import nbformat
import pytest
from ddp_test_support import REPO, committed_text

from ddp_helpers import JobFailedError, JobHungError, RankGroup, torchrun
from ddp_helpers import _strict as strict
from ddp_helpers.outcome import Hang, TorchrunResult

NOTEBOOK_FOLDER = REPO / "notebooks"
NOTEBOOKS = sorted(
    p.relative_to(REPO).as_posix()
    for folder in ("", "solutions", "zh-CN", "zh-CN/solutions")
    for p in (NOTEBOOK_FOLDER / folder).glob("*.ipynb")
)
# Texts that only gloo writes (NCCL's errors read otherwise: "Watchdog caught collective operation timeout").
GLOO_TEXT = re.compile(
    r"gloo[/:]|EnforceNotMet|enforce fail|Connection (\(?closed\|?)?(closed|reset)\)? by peer|"
    r"Timed out waiting \d|connectFullMesh|ProcessGroupGloo|Read error|op\.preamble"
)
POINT_TO_POINT = re.compile(r"\b(send|recv|isend|irecv)\(")
PINNED_FLAGS = re.compile(r"--backend[ =]gloo\b|--env[ =]DDP_BACKEND=gloo\b")

# Cells that may show gloo-only evidence without a pin (none: issue 31 pinned every one); a cell listed here
# that no longer needs it fails the test too, so the list stays true.
KNOWN: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Launch:
    """Where the evidence came from: a torchrun(...) call or a rank group, and whether it pinned gloo."""

    cell: int
    quote: str
    pinned: bool


@dataclass(frozen=True)
class Finding:
    notebook: str
    cell: int
    quote: str  # the statement that holds the evidence, its first line
    launch: Launch | None

    def __str__(self) -> str:
        source = f"cell {self.launch.cell}: {self.launch.quote}" if self.launch else "no launch before it"
        return (
            f"{self.notebook} cell {self.cell}: {self.quote!r} needs gloo, but its launch ({source}) "
            "does not pin it"
        )


def _python(source: str) -> ast.Module:
    """A cell as the Python IPython runs (magics turned into get_ipython() calls)."""
    from IPython.core.inputtransformer2 import TransformerManager

    return ast.parse(TransformerManager().transform_cell(source))


def _constant(node: ast.AST | None, names: dict[str, str]) -> str | None:
    """A string the node stands for: a constant, or a name bound to one earlier in the cell."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return names.get(node.id)
    return None


def _keyword_pins(call: ast.Call) -> bool | None:
    """Whether the call pins gloo (backend=, or DDP_BACKEND in a literal env=); None where it names none."""
    for kw in call.keywords:
        if kw.arg == "backend" and isinstance(kw.value, ast.Constant):
            return kw.value.value == "gloo"
        if kw.arg == "env" and isinstance(kw.value, ast.Dict):
            for key, value in zip(kw.value.keys, kw.value.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "DDP_BACKEND":
                    return isinstance(value, ast.Constant) and value.value == "gloo"
    return None


def _script_pins(call: ast.Call) -> bool:
    """Whether the call's script (its first argument, a path from notebooks/) exists and never names NCCL."""
    if not call.args or not isinstance(call.args[0], ast.Constant) or not isinstance(call.args[0].value, str):
        return False
    path = NOTEBOOK_FOLDER / call.args[0].value
    return path.is_file() and "nccl" not in path.read_text(errors="replace").lower()


def _call_name(call: ast.Call) -> str | None:
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)


def _forwards(call: ast.Call) -> tuple[bool, bool]:
    """Whether a call inside a helper passes on the helper's *args and **kwargs."""
    return any(isinstance(a, ast.Starred) for a in call.args), any(k.arg is None for k in call.keywords)


def _launch_pins(call: ast.Call, helpers: dict[str, ast.Call]) -> bool | None:
    """Whether a torchrun(...)/RankGroup(...) call, or a call of a helper of the notebook that makes one, pins
    gloo; None when the call launches nothing."""
    name = _call_name(call)
    if name in ("torchrun", "RankGroup"):
        own = _keyword_pins(call)
        return own if own is not None else _script_pins(call)
    inner = helpers.get(name or "")
    if inner is None:
        return None
    own = _keyword_pins(inner)
    if own is not None:
        return own
    args, kwargs = _forwards(inner)
    outer = _keyword_pins(call) if kwargs else None
    if outer is not None:
        return outer
    return _script_pins(call if args else inner)


def _in_order(tree: ast.AST) -> list[ast.AST]:
    """The nodes of a cell in source order (outer before inner on one line)."""
    nodes = [n for n in ast.walk(tree) if hasattr(n, "lineno")]
    return sorted(nodes, key=lambda n: (n.lineno, n.col_offset, -getattr(n, "end_lineno", n.lineno)))


def _compares_a_backend(tree: ast.AST) -> bool:
    """Whether the cell compares something with "gloo" or "nccl": it asserts for each backend."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(isinstance(p, ast.Constant) and p.value in ("gloo", "nccl") for p in parts):
                return True
    return False


def _gloo_text_in(test: ast.AST) -> bool:
    """Whether an assert's test holds one of gloo's own texts (a dict key or index does not count)."""
    keys = {id(n.slice) for n in ast.walk(test) if isinstance(n, ast.Subscript)}
    return any(
        isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and id(n) not in keys
        and GLOO_TEXT.search(n.value)
        for n in ast.walk(test)
    )


def _first_line(node: ast.AST) -> str:
    return ast.unparse(node).split("\n", 1)[0][:120]


def findings(cells: list[str], notebook: str = "<notebook>") -> list[Finding]:
    """Each piece of gloo-only evidence in the code cells ``cells`` whose launch does not pin gloo."""
    found: list[Finding] = []
    helpers: dict[str, ast.Call] = {}  # a function of the notebook -> the torchrun call in its body
    group: Launch | None = None  # the rank group %%ranks cells run on
    last: Launch | None = None  # the launch the next evidence comes from
    for index, source in enumerate(cells):
        if source.startswith("%%writefile"):
            continue  # a script: its launch is what counts
        tree = _python(source)
        names: dict[str, str] = {}
        guarded = _compares_a_backend(tree)
        for node in _in_order(tree):
            if isinstance(node, ast.FunctionDef):
                inner = [c for c in ast.walk(node) if isinstance(c, ast.Call) and _call_name(c) == "torchrun"]
                if inner:
                    helpers[node.name] = inner[0]
            elif (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                value = _constant(node.value, names)
                if value is not None:
                    names[node.targets[0].id] = value
            elif isinstance(node, ast.Call):
                magic = _call_name(node) in ("run_line_magic", "run_cell_magic") and node.args
                if magic and _constant(node.args[0], names) == "ranks":
                    line = (_constant(node.args[1], names) if len(node.args) > 1 else None) or ""
                    if _call_name(node) == "run_line_magic":
                        if line.split()[:1] == ["start"]:
                            group = Launch(index, f"%ranks {line}", bool(PINNED_FLAGS.search(line)))
                        continue
                    last = group
                    body = _constant(node.args[2], names) if len(node.args) > 2 else None
                    if body and POINT_TO_POINT.search(body) and not guarded and not (group and group.pinned):
                        quote = next(ln for ln in body.split("\n") if POINT_TO_POINT.search(ln)).strip()
                        found.append(Finding(notebook, index, quote, group))
                    continue
                pins = _launch_pins(node, helpers)
                if pins is not None:
                    last = Launch(index, _first_line(node), pins)
                    if _call_name(node) == "RankGroup":
                        group = last
            elif isinstance(node, ast.Assert) and _gloo_text_in(node.test) and not guarded:
                if not (last and last.pinned):
                    found.append(Finding(notebook, index, _first_line(node), last))
    return found


def notebook_cells(path: str) -> list[str]:
    """The code cells of a notebook, as git holds it."""
    nb = nbformat.reads(committed_text(REPO / path), as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def notebook_findings(path: str) -> Iterator[Finding]:
    nb = nbformat.reads(committed_text(REPO / path), as_version=4)
    cells = [c.source if c.cell_type == "code" else "" for c in nb.cells]  # indices as in the .ipynb file
    yield from findings(cells, path)


# ---- the static check, on examples ------------------------------------------------------------------------


def test_a_gloo_error_text_asserted_on_needs_its_launch_pinned():
    run = 'err = expect_failure("scripts/07_gallery.py", "--case", "x", nproc_per_node=2{pin})'
    check = 'assert re.search(r"Connection (closed|reset) by peer", str(err)), str(err)'
    helper = "def expect_failure(*args, **kwargs):\n    try:\n        torchrun(*args, **kwargs)\n"
    helper += "    except E as e:\n        return e"
    unpinned = findings([helper, run.format(pin=""), check])
    assert [(f.cell, f.launch.cell) for f in unpinned] == [(2, 1)], unpinned
    assert "does not pin it" in str(unpinned[0]) and "Connection" in str(unpinned[0]), str(unpinned[0])
    assert findings([helper, run.format(pin=', backend="gloo"'), check]) == []
    assert findings([helper, run.format(pin=', env={"DDP_BACKEND": "gloo"}'), check]) == []
    guarded = 'if launch == "gloo":\n    ' + check
    assert findings([helper, run.format(pin=""), guarded]) == [], "asserted for gloo only"
    # a key that names gloo is not gloo's text
    assert findings(['info = torchrun("scripts/00_hello.py")', 'assert info["gloo:x"], info']) == []


def test_a_helper_that_pins_inside_pins_every_call_and_a_script_without_nccl_pins_itself():
    helper = 'def run_hang(case):\n    torchrun("scripts/04_ddp.py", "--cases", case{pin})'
    check = 'assert "Timed out waiting 5000ms" in str(err), str(err)'
    assert len(findings([helper.format(pin=""), 'err = run_hang("a")', check])) == 1
    assert findings([helper.format(pin=', backend="gloo"'), 'err = run_hang("a")', check]) == []
    assert findings(['err = torchrun("scripts/00_hang.py", nproc_per_node=2)', check]) == [], (
        "gloo in the script"
    )


def test_point_to_point_in_a_ranks_cell_needs_the_group_pinned():
    cell = (
        "%%ranks\nif rank == 0:\n    dist.send(t, dst=1)\nelse:\n    dist.recv(t, src=0)  # waits for rank 0"
    )
    unpinned = findings(["%load_ext ddp_helpers\n%ranks start -n 2", cell])
    assert [(f.cell, f.quote) for f in unpinned] == [(1, "dist.send(t, dst=1)")], unpinned
    assert unpinned[0].launch.quote == "%ranks start -n 2", unpinned[0]
    assert findings(["%ranks start -n 2 --backend gloo", cell]) == []
    assert findings(["%ranks start -n 2 --env DDP_BACKEND=gloo", cell]) == []
    ring = (
        'ring = "dist.send(t, dst=1)\\ndist.recv(t, src=0)"\nget_ipython().run_cell_magic("ranks", "", ring)'
    )
    assert len(findings(["%ranks start -n 2", ring])) == 1, "a cell run through run_cell_magic counts too"
    assert findings(["%ranks start -n 2", "%%ranks\ndist.all_reduce(t)"]) == [], "a collective is not p2p"


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_every_notebook_pins_gloo_where_its_evidence_needs_it(path):
    found = [f for f in notebook_findings(path)]
    new = [str(f) for f in found if (f.notebook, f.quote) not in KNOWN]
    assert not new, "\n".join(new)
    listed = {quote for notebook, quote in KNOWN if notebook == path}
    stale = listed - {f.quote for f in found}
    assert not stale, f"{path}: pinned now, remove from KNOWN: {sorted(stale)}"


# ---- strict mode ----------------------------------------------------------------------------------------


def _result(stderr: list[str]) -> TorchrunResult:
    return TorchrunResult("torchrun x.py", 1, 1.0, {0: [], 1: []}, {0: stderr, 1: []}, {0: -6, 1: 1})


def test_strict_mode_replaces_a_hang_or_gloos_abort_from_an_unpinned_launch(monkeypatch):
    hung = JobHungError("stalled", _result([]), hang=Hang("stall", 3), stuck_ranks=[1], stacks={})
    aborted = JobFailedError("rank 0 was killed by SIGABRT", _result(["terminate ... 'gloo::EnforceNotMet'"]))
    aborted.rank, aborted.exitcode = 0, -signal.SIGABRT
    own_abort = JobFailedError("rank 0 was killed by SIGABRT", _result(["Fatal Python error: Aborted"]))
    own_abort.rank, own_abort.exitcode = 0, -signal.SIGABRT  # os.abort(): SIGABRT on any backend
    monkeypatch.delenv(strict.STRICT_VARIABLE, raising=False)
    for error in (hung, aborted):
        with pytest.raises(type(error)):
            strict.raise_checked(error, pinned=False)  # what a learner gets: no variable, no change
    monkeypatch.setenv(strict.STRICT_VARIABLE, "1")
    for error in (hung, aborted):
        with pytest.raises(strict.BackendNotPinnedError, match='backend="gloo"') as info:
            strict.raise_checked(error, pinned=False)
        assert info.value.__cause__ is error, info.value.__cause__
        with pytest.raises(type(error)):
            strict.raise_checked(error, pinned=True)
    with pytest.raises(JobFailedError):
        strict.raise_checked(own_abort, pinned=False)


def test_a_launch_counts_as_pinned_by_its_backend_its_environment_or_a_script_without_nccl(tmp_path):
    rule = tmp_path / "rule.py"
    rule.write_text('backend = os.environ.get("DDP_BACKEND") or ("nccl" if cuda else "gloo")\n')
    fixed = tmp_path / "fixed.py"
    fixed.write_text('dist.init_process_group("gloo")\n')
    assert strict.gloo_pinned("gloo", {}, str(rule)) and not strict.gloo_pinned("nccl", {}, str(fixed))
    assert strict.gloo_pinned(None, {"DDP_BACKEND": "gloo"}, str(rule))
    assert not strict.gloo_pinned(None, {"DDP_BACKEND": "nccl"}, str(fixed))
    assert not strict.gloo_pinned(None, {}, str(rule)) and strict.gloo_pinned(None, {}, str(fixed))


HANG = """
import json, os, time
import torch, torch.distributed as dist
backend = os.environ.get("DDP_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
dist.init_process_group(backend)
print(json.dumps({"rank": dist.get_rank()}), flush=True)
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(1))  # rank 1 never joins
else:
    time.sleep(600)
"""


def test_strict_mode_fails_an_unpinned_hang_and_lets_a_pinned_one_through(script, monkeypatch):
    path = script(HANG)
    monkeypatch.setenv(strict.STRICT_VARIABLE, "1")
    with pytest.raises(strict.BackendNotPinnedError) as info:
        torchrun(path, nproc_per_node=2, stall_timeout=2, timeout=300, live=False)
    assert isinstance(info.value.__cause__, JobHungError), info.value.__cause__
    assert "ended as a hang" in str(info.value), str(info.value)
    with pytest.raises(JobHungError):
        torchrun(path, nproc_per_node=2, stall_timeout=2, timeout=300, live=False, backend="gloo")


@pytest.mark.parametrize("backend", [None, "gloo"])
def test_strict_mode_fails_a_ranks_cell_that_hangs_unless_the_group_is_pinned(backend, monkeypatch):
    monkeypatch.setenv(strict.STRICT_VARIABLE, "1")
    group = RankGroup(2, backend=backend, timeout=300)
    expected = JobHungError if backend == "gloo" else strict.BackendNotPinnedError
    try:
        with pytest.raises(expected):
            group.run("dist.all_reduce(torch.ones(1))", [0], stall_timeout=2)
    finally:
        group.stop()
