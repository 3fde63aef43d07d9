"""The code style CI keeps: ruff's formatter and linter, configured in pyproject.toml, find nothing to change.

Run by the README's test command like every other test, so CI keeps both. To fix what they report:
``ruff format .`` and ``ruff check --fix .`` from the repository's root. The formatter leaves notebooks/ out
on purpose; the linter reads notebooks/scripts/, and the last tests here lint every ``%%writefile`` cell of
every notebook (English, Chinese, solutions) with the scripts' rules, since a cell and the file it writes are
one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from ddp_test_support import REPO, committed_text

# Every notebook that writes scripts: the English ones, their Chinese twins and both editions' solutions.
FOLDERS = ("notebooks", "notebooks/solutions", "notebooks/zh-CN", "notebooks/zh-CN/solutions")
NOTEBOOKS = sorted(path for folder in FOLDERS for path in (REPO / folder).glob("*.ipynb"))


def ruff(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run ruff over everything under ``cwd``, each file with the pyproject.toml nearest to it."""
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", "."],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )  # a safety net only


@pytest.mark.parametrize("args", [("format", "--check", "--diff"), ("check",)], ids=["format", "check"])
def test_ruff_finds_nothing_to_change(args):
    done = ruff(*args)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def written_python(notebook: str) -> dict[str, list[tuple[int, str]]]:
    """Each Python file a notebook writes: (cell index, body) of its `%%writefile` cell, then of each `-a`."""
    pieces: dict[str, list[tuple[int, str]]] = {}
    for index, cell in enumerate(nbformat.reads(notebook, as_version=4).cells):
        if cell.cell_type == "code" and cell.source.startswith("%%writefile"):
            first, _, body = cell.source.partition("\n")
            *flags, target = first.split()[1:]
            if not target.endswith(".py"):
                continue
            piece = (index, body if body.endswith("\n") else body + "\n")  # as IPython writes it
            if "-a" in flags or "--append" in flags:
                pieces.setdefault(target, []).append(piece)
            else:
                pieces[target] = [piece]
    return pieces


def cell_line(pieces: list[tuple[int, str]], row: int) -> tuple[int, int]:
    """The cell that wrote a file's line ``row`` (from 1), and the line's number in that cell's source."""
    for index, body in pieces:
        if row <= body.count("\n"):
            return index, row + 1  # the cell's first line is its %%writefile
        row -= body.count("\n")
    raise ValueError(f"the pieces hold fewer lines than {row}")


def writefile_findings(notebooks: dict[str, str], tmp_path: Path) -> list[str]:
    """What `ruff check`, with this repository's pyproject.toml, finds in the files the notebooks write.

    ``notebooks`` maps a notebook's name to its JSON. One ruff process reads them all: each notebook's files
    go under a folder of their own, laid out as in the repository (``notebooks/scripts/...``) beside a copy
    of pyproject.toml, so that its per-file-ignores apply as they do to the committed scripts.
    """
    where: dict[Path, tuple[str, str, list[tuple[int, str]]]] = {}
    for n, (name, notebook) in enumerate(notebooks.items()):
        root = tmp_path / str(n)
        for target, pieces in written_python(notebook).items():
            path = root / "notebooks" / target
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(body for _, body in pieces))
            where[path.resolve()] = (name, target, pieces)
        if root.exists():
            shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    done = ruff("check", "--output-format", "json", cwd=tmp_path)
    assert done.returncode in (0, 1), done.stderr[-4000:]
    findings = []
    for finding in json.loads(done.stdout):
        name, target, pieces = where[Path(finding["filename"]).resolve()]
        index, line = cell_line(pieces, finding["location"]["row"])
        rule = f"{finding['code']} {finding['message']}"
        findings.append(f"{name}, cell {index} ({target}), line {line} of the cell: {rule}")
    return findings


def test_every_writefile_cell_passes_the_scripts_lint(tmp_path):
    notebooks = {path.relative_to(REPO).as_posix(): committed_text(path) for path in NOTEBOOKS}
    assert {path.parent for path in NOTEBOOKS} == {REPO / folder for folder in FOLDERS}
    findings = writefile_findings(notebooks, tmp_path)
    assert not findings, "\n".join(findings)


def test_writefile_findings_name_the_cell_an_appended_piece_came_from(tmp_path):
    cells = [
        "%%writefile scripts/99_x.py\nimport json\nimport os\n\nprint(json.dumps(1))",
        "print('not written')",
        "%%writefile -a scripts/99_x.py\nprint(1)\nprint(undefined)",
        "%%writefile scripts/99_x.sbatch\n#!/bin/bash\nprint(undefined)",
    ]
    notebook = nbformat.writes(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]))
    assert writefile_findings({"99_x.ipynb": notebook}, tmp_path) == [
        "99_x.ipynb, cell 0 (scripts/99_x.py), line 3 of the cell: F401 `os` imported but unused",
        "99_x.ipynb, cell 2 (scripts/99_x.py), line 3 of the cell: F821 Undefined name `undefined`",
    ]
