"""Each notebook's reading time, computed from its own cells, and the lines that state it: each notebook's
header and its row in both READMEs and in WORKSHOP.md.

Careful reading, as the learner review of 2026-12-02 measured it: prose at 230 words a minute, code a learner
reads to understand and copy at 15 lines a minute, evidence (asserts, and cells tagged ``evidence``) at 30.
Prose is the Markdown outside fenced code, without link targets; a word is a token with a letter or a digit.
Code is every non-blank line of a code cell and of a fenced block. Run All is the notebook's own time in
CI's last measured run (``tests/durations.json``, written by ``benchmarks/suite_time.py --durations``).

Usage: ``python tools/reading_time.py`` prints the table; ``--write`` rewrites each notebook's header line
(English and Chinese) and the rows of the READMEs and WORKSHOP.md; ``--check`` exits 1 when one is stale.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
DURATIONS = REPO / "tests" / "durations.json"
WORDS_PER_MINUTE, CODE_LINES_PER_MINUTE, EVIDENCE_LINES_PER_MINUTE = 230, 15, 30
FENCE = re.compile(r"```.*?```", re.S)
HEADER = {  # the header line, per edition: it sits right under the notebook's title
    "en": "*Reading time: about {read} min · Run All: about {run} min on 2 CPU cores*",
    "zh": "*阅读时间：约 {read} 分钟 · 全部运行：2 核 CPU 上约 {run} 分钟*",
}
HEADER_PATTERN = {
    edition: re.compile(re.escape(text).replace(r"\{read\}", r"\d+").replace(r"\{run\}", r"\d+"))
    for edition, text in HEADER.items()
}


@dataclass(frozen=True)
class Size:
    """What a learner reads in one notebook."""

    words: int
    code_lines: int
    evidence_lines: int

    @property
    def minutes(self) -> float:
        """Careful reading time."""
        return (
            self.words / WORDS_PER_MINUTE
            + self.code_lines / CODE_LINES_PER_MINUTE
            + self.evidence_lines / EVIDENCE_LINES_PER_MINUTE
        )


def prose(markdown: str) -> str:
    """The Markdown a learner reads as prose: fenced code, link targets and HTML comments removed."""
    text = FENCE.sub("", markdown)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return re.sub(r"\]\([^)]*\)", "]", text)


def word_count(text: str) -> int:
    return sum(1 for token in text.split() if re.search(r"[A-Za-z0-9]", token))


def fenced_lines(markdown: str) -> int:
    return sum(1 for block in FENCE.findall(markdown) for line in block.splitlines()[1:-1] if line.strip())


def read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def size(nb: nbformat.NotebookNode) -> Size:
    """Words, code lines and evidence lines of one notebook."""
    words = code = evidence = 0
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            words += word_count(prose(cell.source))
            code += fenced_lines(cell.source)
        elif cell.cell_type == "code":
            lines = [line for line in cell.source.splitlines() if line.strip()]
            if "evidence" in cell.metadata.get("tags", []):
                evidence += len(lines)
            else:
                asserts = sum(1 for line in lines if line.lstrip().startswith("assert "))
                evidence, code = evidence + asserts, code + len(lines) - asserts
    return Size(words, code, evidence)


def run_all_minutes(path: Path, durations: dict[str, float]) -> int:
    """Minutes the notebook took in CI's last measured run (at least 1)."""
    key = f"notebooks/{path.name}::{path.name}"
    if key not in durations:
        raise SystemExit(
            f"{path.name} is not in {DURATIONS.relative_to(REPO)}: run "
            "`python benchmarks/suite_time.py --durations`, then this tool with --write"
        )
    return max(1, math.ceil(durations[key] / 60))


def english() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def headers(reader: Callable[[Path], nbformat.NotebookNode] = read) -> dict[Path, str]:
    """The header line each notebook should carry: the English one's numbers, in both editions."""
    wanted = {}
    for name, (read_minutes, run_minutes) in numbers(reader).items():
        wanted[NOTEBOOKS / f"{name}.ipynb"] = HEADER["en"].format(read=read_minutes, run=run_minutes)
        wanted[NOTEBOOKS / "zh-CN" / f"{name}.ipynb"] = HEADER["zh"].format(
            read=read_minutes, run=run_minutes
        )
    return wanted


ROW = re.compile(
    r"^(\| \[[^]]*\]\(notebooks/(?:zh-CN/)?(\d\d_\w+)\.ipynb\) \|.*\| )"
    r"\d+( min| 分钟) \| \d+( min| 分钟) \|$",
    re.M,
)
READMES = (
    REPO / "README.md",
    REPO / "README.zh-CN.md",
    REPO / "WORKSHOP.md",
)  # pages with a row per notebook


def readme_rows(text: str, minutes: dict[str, tuple[int, int]]) -> str:
    """A README with each notebook row's last two cells (reading, Run All) set to ``minutes[name]``."""
    return ROW.sub(lambda m: f"{m[1]}{minutes[m[2]][0]}{m[3]} | {minutes[m[2]][1]}{m[4]} |", text)


def numbers(reader: Callable[[Path], nbformat.NotebookNode] = read) -> dict[str, tuple[int, int]]:
    """Notebook name -> (careful reading minutes, Run All minutes)."""
    durations = json.loads(DURATIONS.read_text())
    return {p.stem: (round(size(reader(p)).minutes), run_all_minutes(p, durations)) for p in english()}


def with_header(title_cell: str, header: str, edition: str) -> str:
    """The title cell with its header line replaced, or inserted right under the title."""
    if HEADER_PATTERN[edition].search(title_cell):
        return HEADER_PATTERN[edition].sub(header, title_cell, count=1)
    title, _, rest = title_cell.partition("\n")
    return f"{title}\n\n{header}\n{rest}" if rest.startswith("\n") else f"{title}\n\n{header}\n\n{rest}"


def stale(reader: Callable[[Path], nbformat.NotebookNode] = read) -> list[str]:
    """Notebooks whose title cell lacks the header line it should have, and READMEs whose rows are stale."""
    old = [
        str(path.relative_to(REPO))
        for path, header in headers(reader).items()
        if header not in reader(path).cells[0].source
    ]
    minutes = numbers(reader)
    return old + [p.name for p in READMES if readme_rows(p.read_text(), minutes) != p.read_text()]


def write() -> None:
    """Rewrite every notebook's header line and the READMEs' notebook rows, until they hold (the header's own
    words count, so a new header can move a notebook's reading time by a minute: a second pass settles it)."""
    for _ in range(3):
        if not write_once():
            return
    raise SystemExit("reading_time: the headers did not settle in 3 passes")


def write_once() -> bool:
    """One pass of ``write``; whether it changed anything."""
    changed = False
    minutes = numbers()
    for readme in READMES:
        text = readme.read_text()
        if (new := readme_rows(text, minutes)) != text:
            readme.write_text(new)
            print("updated", readme.name)
            changed = True
    for path, header in headers().items():
        nb = read(path)
        edition = "zh" if path.parent.name == "zh-CN" else "en"
        new = with_header(nb.cells[0].source, header, edition)
        if new != nb.cells[0].source:
            nb.cells[0].source = new
            nbformat.write(nb, path)
            print("updated", path.relative_to(REPO))
            changed = True
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the header lines")
    parser.add_argument("--check", action="store_true", help="exit 1 when a header line is stale")
    args = parser.parse_args()
    if args.write:
        write()
    elif args.check:
        if old := stale():
            sys.exit("stale headers (run python tools/reading_time.py --write): " + ", ".join(old))
    else:
        print("| notebook | words | code lines | evidence lines | careful min |\n|---|---|---|---|---|")
        for path in english():
            s = size(read(path))
            print(f"| {path.name} | {s.words} | {s.code_lines} | {s.evidence_lines} | {s.minutes:.0f} |")


if __name__ == "__main__":
    main()
