"""Build the readable edition: the executed notebooks (English and Chinese) as a static site in site/.

MkDocs with the mkdocs-jupyter plugin renders the notebooks (through nbconvert) in the Material theme;
this script only gathers the pages, keeping the repository's layout so that every relative link in
the notebooks and READMEs works as it is. Each English notebook is executed once: the test suite saves
the copies it executes in build/executed/ (see conftest.py at the repository's root), reused here when
their code still matches; anything missing is executed now. A Chinese notebook has the same code
cells as its English twin (a test checks), so it shows the English execution's outputs.
Usage: ``python tools/build_site.py`` (then open site/index.html, or serve it: see README.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import nbformat
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
EXECUTED = ROOT / "build" / "executed"  # written by the test run (conftest.py) and by this script
SOURCE = ROOT / "build" / "site-src"
HOOKS = ROOT / "tools" / "site_hooks.py"  # heading ids in every script (mkdocs-jupyter's keep ASCII only)
FOLD = ROOT / "tools" / "fold_evidence.js"  # folds the cells tagged "evidence", as JupyterLab shows them
PAGES = [
    "README.md",
    "README.zh-CN.md",
    "SEED_POST.md",
    "WORKSHOP.md",
    "HELPERS.md",
    "MEASURES.md",
    "CONTRIBUTING.md",
    "TESTING.md",
]
# Notebook 09, the error atlas: its first two tables list every message the series reproduces, and where.
ATLAS = "09_errors_learners_meet.ipynb"
ERROR_PAGES = {"": "errors.md", "zh-CN/": "errors.zh-CN.md"}  # the error index, per edition (folder: page)
ERROR_INTRO = {
    "": (
        "# Error index\n\nEvery error message this series reproduces, each linked to the section whose cells "
        "reproduce it, say why it happens and prove the fix. Search this page (Ctrl+F, ⌘F) for the words "
        "of your message: the numbers, names and paths in it vary from machine to machine. The list is made "
        "from the tables at the top of notebook 09, the error atlas.\n\n"
        "| the message, or what you see | where |\n|---|---|\n"
    ),
    "zh-CN/": (
        "# 报错索引\n\n本系列复现过的每一条报错，都链接到复现它、说明原因并证明修复方法的那一节。在本页搜索"
        "（Ctrl+F、⌘F）你看到的报错里的词即可：其中的数字、名称和路径因机器而异。这份列表由 notebook 09"
        "（报错图鉴）开头的两张表格生成。\n\n"
        "| 报错信息，或者你看到的现象 | 在哪里 |\n|---|---|\n"
    ),
}


def english_notebooks() -> list[Path]:
    pattern = "[0-9][0-9]_*.ipynb"  # 00 to 99
    return sorted(NOTEBOOKS.glob(pattern)) + sorted((NOTEBOOKS / "solutions").glob(pattern))


def code(nb: nbformat.NotebookNode) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def executed(path: Path) -> nbformat.NotebookNode:
    """The notebook as committed, with the outputs of its code cells: from the test run's copy if its code is
    current, else from executing it here."""
    source = nbformat.read(path, as_version=4)
    saved = EXECUTED / path.relative_to(NOTEBOOKS)
    run = nbformat.read(saved, as_version=4) if saved.is_file() else None
    if run is None or code(run) != code(source):
        from nbclient import NotebookClient

        start = time.monotonic()
        run = nbformat.read(path, as_version=4)
        NotebookClient(run, timeout=1800, kernel_name="python3").execute(cwd=str(path.parent))
        print(f"executed {path.relative_to(ROOT)} in {time.monotonic() - start:.0f} s", flush=True)
        saved.parent.mkdir(parents=True, exist_ok=True)
        partial = saved.with_name(f"{saved.name}.{os.getpid()}.tmp")  # whole or not at all, as conftest.py
        nbformat.write(run, partial)
        os.replace(partial, saved)
    return with_outputs(source, run)


def with_outputs(nb: nbformat.NotebookNode, run: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """``nb`` with the outputs of ``run``, code cell by code cell: the same notebook executed, or the English
    twin of a translation (a test keeps their code the same)."""
    mine = [c for c in nb.cells if c.cell_type == "code"]
    ran = [c for c in run.cells if c.cell_type == "code"]
    if [c.source for c in mine] != [c.source for c in ran]:
        raise SystemExit("a notebook's code differs from the execution it should show")
    for cell, done in zip(mine, ran, strict=True):
        cell.outputs, cell.execution_count = done.outputs, done.execution_count
    return nb


LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)#\s]+)(#[^)\s]*)?\)")


def site_links(text: str, notebook: bool) -> str:
    """Relative links as the site needs them: README.md is the home page; in a notebook, .md and .ipynb
    targets become the .html pages (mkdocs rewrites those of Markdown pages itself)."""

    def fix(m: re.Match) -> str:
        target, anchor = m[1], m[2] or ""
        target = re.sub(r"(^|/)README\.md$", r"\1index.md", target)
        if notebook:
            target = re.sub(r"\.(md|ipynb)$", ".html", target)
        return f"]({target}{anchor})"

    return LINK.sub(fix, text)


def write_notebook(nb: nbformat.NotebookNode, target: Path) -> None:
    ids = site_heading_ids(nb)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = site_links(cell.source, notebook=True)
            cell.source = re.sub(r"\]\(#([^)\s]+)\)", lambda m: f"](#{ids.get(m[1], m[1])})", cell.source)
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)


def site_hooks() -> ModuleType:
    """tools/site_hooks.py, loaded (and its patches applied) as mkdocs loads it: the site's heading ids."""
    spec = importlib.util.spec_from_file_location("site_hooks", HOOKS)
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def site_heading_ids(nb: nbformat.NotebookNode) -> dict[str, str]:
    """A heading's id in JupyterLab (its text, spaces as "-"), which links within a notebook use -> its id on
    the site (mkdocs-jupyter's renderer), so that such a link jumps on both."""
    hooks = site_hooks()
    ids = {}
    for cell in nb.cells:
        for line in hooks.heading_lines(cell.source) if cell.cell_type == "markdown" else []:
            if site := hooks.heading_id(line):
                ids[line.lstrip("#").strip().replace(" ", "-")] = site
    return ids


def heading_anchors(nb: nbformat.NotebookNode) -> dict[str, str]:
    """Section number ("1a", "3") -> the id its heading gets on the site: rendered by mkdocs-jupyter's own
    Markdown renderer, so that the index links where the page's own heading links go."""
    hooks = site_hooks()
    anchors: dict[str, str] = {}
    for cell in nb.cells:
        for line in hooks.heading_lines(cell.source) if cell.cell_type == "markdown" else []:
            number = re.match(r"#{2,3} (\d+[a-z]?)\. ", line)
            if number and number[1] not in anchors:
                anchors[number[1]] = hooks.heading_id(line)
    return anchors


def error_index(folder: str = "") -> str:
    """The error index of one edition ("" or "zh-CN/") as Markdown: every row of the atlas's two tables, each
    message linked to its section's heading, in notebook 09 or in the notebook that reproduces it."""
    atlas_path = NOTEBOOKS / folder / ATLAS
    atlas = nbformat.read(atlas_path, as_version=4)
    anchors = {ATLAS: heading_anchors(atlas)}
    rows = []
    table = next(c.source for c in atlas.cells if c.cell_type == "markdown" and "| 1a |" in c.source)
    for first, second in re.findall(r"^\| (.+?) \| (.+?) \|$", table, re.M):
        here = re.fullmatch(r"\d+[a-z]?", first)
        elsewhere = re.fullmatch(r"\[(\d\d) §(\d+[a-z]?)\]\((\d\d_\w+\.ipynb)\)", second)
        if here:  # | 1a | the message |: a section of notebook 09
            message, notebook, section = second, ATLAS, first
        elif elsewhere:  # | the message | [07 §1a](07_debugging.ipynb) |
            message, notebook, section = first, elsewhere[3], elsewhere[2]
        else:
            continue  # a header or a separator row
        if notebook not in anchors:
            anchors[notebook] = heading_anchors(nbformat.read(NOTEBOOKS / folder / notebook, as_version=4))
        if section not in anchors[notebook]:
            raise SystemExit(f"{atlas_path.name}: no section {section} in {notebook}, which its table names")
        link = f"notebooks/{folder}{notebook}#{anchors[notebook][section]}"
        rows.append(f"| {message} | [{notebook[:2]} §{section}]({link}) |")
    if not rows:
        raise SystemExit(f"{atlas_path.name}: no table of messages found")
    return ERROR_INTRO[folder] + "\n".join(rows) + "\n"


def gather() -> list[str]:
    """Write the site's sources into build/site-src/ and return the navigation (paths relative to it)."""
    shutil.rmtree(SOURCE, ignore_errors=True)
    for page in PAGES:
        if not (ROOT / page).is_file():
            raise SystemExit(f"{page} is missing")
        text = site_links(
            (ROOT / page).read_text(encoding="utf-8").replace("(notebooks/zh-CN/)", "(README.zh-CN.md)"),
            notebook=False,
        )
        target = SOURCE / ("index.md" if page == "README.md" else page)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    for folder, page in ERROR_PAGES.items():
        if (NOTEBOOKS / folder / ATLAS).is_file():
            (SOURCE / page).write_text(error_index(folder), encoding="utf-8")
    nav = []
    for path in english_notebooks():
        rel = path.relative_to(ROOT)
        nb = executed(path)
        zh = NOTEBOOKS / "zh-CN" / path.relative_to(NOTEBOOKS)
        if zh.is_file():  # the language switch, on top of the English page (the Chinese pages link back)
            write_notebook(with_outputs(nbformat.read(zh, as_version=4), nb), SOURCE / zh.relative_to(ROOT))
            link = f"{'../' * (len(rel.parts) - 2)}zh-CN/{path.relative_to(NOTEBOOKS).as_posix()}"
            nb.cells.insert(0, nbformat.v4.new_markdown_cell(f"中文版：[{path.stem}]({link})"))
        write_notebook(nb, SOURCE / rel)
        nav.append(rel.as_posix())
    # the diagrams, pre-rendered (tools/render_diagrams.py)
    shutil.copytree(
        NOTEBOOKS / "images", SOURCE / "notebooks" / "images", ignore=shutil.ignore_patterns("*.mmd")
    )
    (SOURCE / FOLD.name).write_text(FOLD.read_text(encoding="utf-8"), encoding="utf-8")
    glossary = NOTEBOOKS / "zh-CN" / "术语表.md"
    if glossary.is_file():
        shutil.copy(glossary, SOURCE / glossary.relative_to(ROOT))
    for script in sorted((NOTEBOOKS / "scripts").glob("*.py")):
        page = SOURCE / "notebooks" / "scripts" / f"{script.stem}.md"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(
            f"# scripts/{script.name}\n\nWritten by a `%%writefile` cell of notebook "
            f"{script.name[:2]}; run it yourself with `torchrun --standalone --nproc-per-node=2 "
            f"scripts/{script.name}` from `notebooks/`.\n\n```python\n{script.read_text()}```\n",
            encoding="utf-8",
        )
    return nav


def mkdocs_config(nav: list[str], out: Path) -> Path:
    """mkdocs.yml for the gathered sources: English, then the Chinese edition, then the rest."""
    main = [p for p in nav if "/solutions/" not in p]
    solutions = [p for p in nav if "/solutions/" in p]
    zh = [
        p.replace("notebooks/", "notebooks/zh-CN/", 1)
        for p in nav
        if (SOURCE / p.replace("notebooks/", "notebooks/zh-CN/", 1)).is_file()
    ]
    scripts = sorted(f"notebooks/scripts/{p.name}" for p in (SOURCE / "notebooks" / "scripts").glob("*.md"))
    errors = {folder: [page] if (SOURCE / page).is_file() else [] for folder, page in ERROR_PAGES.items()}
    config = {
        "site_name": "ddp-notebooks",
        "site_description": (
            "PyTorch DistributedDataParallel, one concept per notebook, every claim proven by a "
            "cell that runs"
        ),
        "docs_dir": str(SOURCE),
        "site_dir": str(out),
        "use_directory_urls": False,  # plain .html files: the site also opens from disk
        "theme": {
            "name": "material",
            "font": False,  # the reader's own fonts: the site loads nothing from the network
            "features": ["navigation.footer"],  # previous / next at the bottom of every page
        },
        # executed once, above; no render cache: its key ignores tools/site_hooks.py, so old pages outlived it
        "plugins": [{"mkdocs-jupyter": {"execute": False, "include_source": True, "cache": False}}],
        "markdown_extensions": ["tables", "fenced_code", "admonition"],
        "extra_javascript": [FOLD.name],
        "hooks": [str(HOOKS)],
        "nav": [
            {"Home": "index.md"},
            {"Notebooks": main + errors[""]},
            {"Solutions": solutions},
            {
                "中文": [
                    "README.zh-CN.md",
                    *[p for p in zh if "/solutions/" not in p],
                    *errors["zh-CN/"],
                    {"参考答案": [p for p in zh if "/solutions/" in p]},
                ]
            },
            {"Scripts": scripts},
            "SEED_POST.md",
            "WORKSHOP.md",
            "HELPERS.md",
            "MEASURES.md",
            "CONTRIBUTING.md",
        ],
    }
    path = ROOT / "build" / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True, sort_keys=False, width=120), encoding="utf-8")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(ROOT / "site"))
    args = parser.parse_args()
    config = mkdocs_config(gather(), Path(args.out).resolve())
    # --strict: a warning fails the build, above all a Markdown page's link to a file that is not among the
    # pages (mkdocs leaves such a link as it is: README's link to a notebook the site left out pointed at
    # nothing). Not --quiet: it sets mkdocs' log level above its warnings, so strict mode would never see one.
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config)],
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:  # mkdocs' warnings and errors, without its INFO messages (and their lines)
        shown, info = [], False
        for line in (done.stdout + done.stderr).splitlines():
            info = line.startswith("INFO") or (info and line.startswith(" "))
            shown += [] if info else [line]
        print("\n".join(shown), file=sys.stderr)
    else:
        print(f"site written to {args.out}: open {Path(args.out) / 'index.html'}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
