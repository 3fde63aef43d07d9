"""The project's own rules: notebooks, scripts, dependency lists, README and CI agree."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
import tomllib
import yaml
from ddp_test_support import REPO, committed_text

from ddp_helpers.pins import read_pins

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
SCRIPTS = sorted((REPO / "notebooks" / "scripts").glob("*.py"))
CONDA_NAMES = {"torch": "pytorch"}  # where conda-forge names a package differently


def _writefile_cells(nb_path: Path) -> dict[str, str]:
    """Each file the notebook writes, as its cells leave it: a `%%writefile` cell, then its `-a` pieces.

    IPython writes a cell's body, with a newline added when it lacks one. A `%%writefile -a` piece appends
    to the file an earlier cell created; appending to a file no earlier cell writes would depend on what a
    previous run left there, so it fails.
    """
    nb = nbformat.reads(committed_text(nb_path), as_version=4)
    cells: dict[str, str] = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith("%%writefile"):
            first, _, body = cell.source.partition("\n")
            *flags, target = first.split()[1:]
            body = body if body.endswith("\n") else body + "\n"
            if "-a" in flags or "--append" in flags:
                assert target in cells, f"{nb_path.name}: `{first}`: no earlier cell writes {target}"
                cells[target] += body
            else:
                cells[target] = body
    return cells


def test_there_are_notebooks_and_scripts():
    assert NOTEBOOKS and SCRIPTS


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_clean(nb_path):
    assert re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", nb_path.name), "name notebooks NN_snake_case.ipynb"
    nb = nbformat.reads(committed_text(nb_path), as_version=4)  # what git holds, not a learner's saved run
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "strip outputs before committing"
            assert "!torchrun" not in cell.source.replace(" ", ""), "use ddp_helpers.torchrun, not !torchrun"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for heading in ("What you will learn", "Summary", "Exercises"):
        assert heading in text, f"{nb_path.name} lacks a '{heading}' section"


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_scripts_equal_their_writefile_cells(nb_path):
    for target, body in _writefile_cells(nb_path).items():
        assert target.startswith("scripts/"), f"{target}: scripts live in notebooks/scripts/"
        assert Path(target).name.startswith(nb_path.name[:2] + "_"), (
            f"{target}: prefix it with the notebook's number"
        )
        path = REPO / "notebooks" / target
        assert path.exists(), f"{target} is written by {nb_path.name} but not committed"
        assert committed_text(path).rstrip() == body.rstrip(), f"{target} differs from its %%writefile cell"


def test_every_script_comes_from_a_notebook():
    written = {t for nb in NOTEBOOKS for t in _writefile_cells(nb)}
    orphans = [p.name for p in SCRIPTS if f"scripts/{p.name}" not in written]
    assert not orphans, f"scripts no notebook writes: {orphans}"


def test_writefile_pieces_are_concatenated_after_a_first_cell(tmp_path, monkeypatch):
    monkeypatch.setitem(_writefile_cells.__globals__, "committed_text", lambda path: path.read_text())

    def notebook(*sources: str) -> Path:
        path = tmp_path / "99_x.ipynb"
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources]), path)
        return path

    first, piece = "%%writefile scripts/99_x.py\na = 1", "%%writefile -a scripts/99_x.py\n\n\nb = 2"
    assert _writefile_cells(notebook(first, "print(a)", piece)) == {"scripts/99_x.py": "a = 1\n\n\nb = 2\n"}
    with pytest.raises(AssertionError, match="no earlier cell writes scripts/99_x.py"):
        _writefile_cells(notebook(piece, first))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_scripts_import_only_torch_torchvision_and_stdlib(path):
    allowed = set(sys.stdlib_module_names) | {"torch", "torchvision", "__future__"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        else:
            continue
        for name in names:
            assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def _requirement_names(reqs: list[str]) -> dict[str, str]:
    out = {}
    for req in reqs:
        m = re.match(r"([A-Za-z0-9_.-]+)\s*(.*)", req)
        out[m[1].lower()] = m[2].replace(" ", "")
    return out


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pip_deps = _requirement_names(project["dependencies"] + project["optional-dependencies"]["test"])
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    conda = _requirement_names([d for d in env["dependencies"] if isinstance(d, str)])
    assert conda.pop("python").startswith("=3.11") and "pip" in conda
    conda.pop("pip")
    expected = {CONDA_NAMES.get(name, name): spec for name, spec in pip_deps.items()}
    assert conda == expected


def _readme_block(marker: str, readme: str = "README.md") -> str:
    text = (REPO / readme).read_text()
    m = re.search(rf"<!-- {marker} -->\s*```(?:bash|sh)?\n(.*?)\n```\s*<!-- /{marker} -->", text, re.S)
    assert m, f"{readme} lacks the {marker} block"
    return m[1].strip()


def test_readme_commands_and_ci_agree():
    test_cmd, open_cmd = _readme_block("test-command"), _readme_block("open-command")
    assert "\n" not in test_cmd and "\n" not in open_cmd, "each is one command a user can paste"
    assert "--allow-root" in open_cmd and "jupyter lab" in open_cmd
    assert "pytest" in test_cmd and "constraints.txt" in test_cmd
    ci = (REPO / ".ci" / "run").read_text()
    assert "test-command" in ci, ".ci/run must run the README's test command verbatim"
    site_cmd = _readme_block("site-command")
    assert "\n" not in site_cmd and site_cmd.startswith(test_cmd.split(" && .venv/bin/python")[0])
    assert site_cmd.endswith(".venv/bin/python tools/build_site.py"), site_cmd
    assert "site/" in (REPO / ".gitignore").read_text().splitlines()


def _build_site():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_site", REPO / "tools" / "build_site.py")
    build_site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_site)
    return build_site


def test_the_site_config_is_written_by_a_yaml_library(tmp_path, monkeypatch):
    """build_site.py's mkdocs.yml survives folder names YAML would misread if pasted into text (': ', '#')."""
    build_site = _build_site()
    odd = tmp_path / "a: b #c"
    (odd / "notebooks" / "zh-CN").mkdir(parents=True)
    (odd / "notebooks" / "zh-CN" / "00_x.ipynb").write_text("{}")
    (tmp_path / "build").mkdir()
    monkeypatch.setattr(build_site, "SOURCE", odd)
    monkeypatch.setattr(build_site, "ROOT", tmp_path)
    config = yaml.safe_load(build_site.mkdocs_config(["notebooks/00_x.ipynb"], odd / "site").read_text())
    assert config["docs_dir"] == str(odd) and config["site_dir"] == str(odd / "site"), config
    assert config["nav"][1] == {"Notebooks": ["notebooks/00_x.ipynb"]}, config["nav"]
    assert config["nav"][3] == {"中文": ["README.zh-CN.md", "notebooks/zh-CN/00_x.ipynb", {"参考答案": []}]}


def test_the_site_has_a_page_for_every_notebook_the_markdown_pages_link_to():
    """Every notebook (00 to 99) and every solutions notebook is gathered as a page of the site: mkdocs turns
    a Markdown page's link into a link to the page only when the target is one, and leaves the others
    pointing at nothing (a glob of 0* left notebook 10 out, and the README's link to it broken)."""
    build_site = _build_site()
    solutions = sorted((REPO / "notebooks" / "solutions").glob("*.ipynb"))
    gathered = {p.relative_to(REPO).as_posix() for p in build_site.english_notebooks()}
    assert gathered == {p.relative_to(REPO).as_posix() for p in NOTEBOOKS + solutions}, sorted(gathered)
    for page in build_site.PAGES:
        text = (REPO / page).read_text(encoding="utf-8")
        for target in re.findall(r"\]\((notebooks/[^)#\s]+\.ipynb)", text):
            assert target.replace("notebooks/zh-CN/", "notebooks/", 1) in gathered, (page, target)
            assert (REPO / target).is_file(), (page, target)


def test_the_error_index_links_every_message_to_the_heading_of_its_section():
    """The site's error index: one row per row of notebook 09's two tables, in both editions, each linking to
    the heading id the section gets on its page; every lettered section of 09 is in the table."""
    build_site = _build_site()
    for folder in ("", "zh-CN/"):
        atlas = nbformat.read(REPO / "notebooks" / folder / build_site.ATLAS, as_version=4)
        table = next(c.source for c in atlas.cells if c.cell_type == "markdown" and "| 1a |" in c.source)
        here = re.findall(r"^\| (\d+[a-z]?) \| ", table, re.M)
        elsewhere = re.findall(r"^\| .+ \| \[\d\d §\d+[a-z]?\]\(\d\d_\w+\.ipynb\) \|$", table, re.M)
        lettered = {s for s in build_site.heading_anchors(atlas) if re.fullmatch(r"\d+[a-z]", s)}
        assert lettered <= set(here), f"{folder}09's table lacks sections {sorted(lettered - set(here))}"
        links = re.findall(r"\]\(notebooks/([^#)]+)#([^)]+)\) \|$", build_site.error_index(folder), re.M)
        assert len(links) == len(here) + len(elsewhere) and len(elsewhere) > 10, (folder, len(links))
        for notebook, anchor in links:
            page = nbformat.read(REPO / "notebooks" / notebook, as_version=4)
            assert anchor in build_site.heading_anchors(page).values(), (notebook, anchor)


def test_the_error_index_refuses_a_section_that_does_not_exist(tmp_path, monkeypatch):
    build_site = _build_site()
    atlas = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_markdown_cell("| 1a | `Some error` |\n\n## 1. Only")]
    )
    nbformat.write(atlas, tmp_path / build_site.ATLAS)
    monkeypatch.setattr(build_site, "NOTEBOOKS", tmp_path)
    with pytest.raises(SystemExit, match="no section 1a in 09_errors_learners_meet.ipynb"):
        build_site.error_index()


def test_readme_lists_every_notebook():
    text = (REPO / "README.md").read_text()
    for nb in NOTEBOOKS:
        assert f"notebooks/{nb.name}" in text, f"README's table lacks {nb.name}"


def test_constraints_pin_what_the_series_is_tested_with():
    """Read as the doctor and tools/torch_matrix.py read it (ddp_helpers.pins)."""
    assert read_pins(REPO / "constraints.txt") == {"torch": "2.14.1", "torchvision": "0.29.1"}


DOCS = [
    REPO / p
    for p in ("README.md", "SEED_POST.md", "CONTRIBUTING.md", "TESTING.md", "HELPERS.md", "MEASURES.md")
]
# inline code that reads as a statement
SHOWN_CALL = re.compile(r"(assert |[A-Za-z_][\w.]*\(|[A-Za-z_]\w* = [\w.]+\()")


def _shown_code(markdown: str) -> list[str]:
    """Python a reader may copy from markdown: ```python blocks, inline code that is a statement or a call."""
    blocks = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", markdown, re.S)]
    inline = [
        m
        for m in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", markdown, flags=re.S))
        if SHOWN_CALL.match(m)
    ]
    return blocks + inline


def _python_of_cell(source: str) -> str:
    """A code cell as the kernel runs it: IPython turns %magics and !commands into Python first."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


@pytest.mark.parametrize("path", NOTEBOOKS + DOCS, ids=lambda p: p.name)
def test_code_shown_to_a_reader_parses(path):
    if path.suffix == ".ipynb":
        cells = nbformat.read(path, as_version=4).cells
        code = [_python_of_cell(c.source) for c in cells if c.cell_type == "code"]
        shown = [s for c in cells if c.cell_type == "markdown" for s in _shown_code(c.source)]
    else:
        code, shown = [], _shown_code(path.read_text())
    for snippet in code + [_python_of_cell(s) for s in shown]:  # shown code may be a cell, with %magics
        try:
            compile(snippet, path.name, "exec")
        except SyntaxError as err:
            pytest.fail(f"{path.name}: code shown to a reader does not parse ({err.msg}):\n{snippet[:300]}")


def test_nothing_points_outside_the_repository():
    tracked = [
        REPO / p
        for p in (
            "README.md",
            "README.zh-CN.md",
            "CONTRIBUTING.md",
            "TESTING.md",
            "SEED_POST.md",
            "HELPERS.md",
            "MEASURES.md",
            "pyproject.toml",
        )
    ]
    tracked += NOTEBOOKS + SCRIPTS + sorted((REPO / "ddp_helpers").glob("*.py"))
    outside = [p.name for p in tracked if re.search(r"\.\./shared|shared/seed", p.read_text())]
    assert not outside, f"these point at ../shared, which a clone does not have: {outside}"


def test_no_large_file_or_wheel_is_tracked():
    """A clone stays small: nothing over 1 MB and no built wheel is committed (one slipped in, a0fd03d)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    paths = [p for p in tracked.stdout.split("\0") if p and (REPO / p).is_file()]
    assert paths, "git lists no tracked files"
    large = {p: (REPO / p).stat().st_size for p in paths if (REPO / p).stat().st_size > 1_000_000}
    wheels = [p for p in paths if p.endswith(".whl")]
    assert not large and not wheels, f"tracked by mistake: {large or ''} {wheels or ''}"


# Scripts whose setup() differs from 00_hello.py's on purpose (each script stands alone, so each has a copy).
SETUP_VARIANTS = {
    "05_elastic.py": "a --plain-init switch; join_process_group, which survives torchrun's restarts",
    "06_train.py": "also runs under plain python (nanoGPT's RANK test); join_process_group",
    "07_gallery.py": "returns (rank, device) only",
    "07_tools.py": "passes --pg-timeout to init_process_group",
    "08_train.py": "06's, with device_id= for NCCL (the template for real projects)",
}


def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def _device_block(setup: ast.FunctionDef) -> str:
    """The backend choice and the device/set_device `if` that every setup() shares, as an AST dump."""
    body = setup.body
    i = next(
        i for i, s in enumerate(body) if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "backend"
    )
    nxt = next(s for s in body[i + 1 :] if isinstance(s, ast.If))
    return ast.dump(body[i]) + ast.dump(nxt)


def test_setup_copies_agree_or_differ_only_as_listed():
    reference = _functions(REPO / "notebooks" / "scripts" / "00_hello.py")["setup"]
    with_setup = {p.name: _functions(p)["setup"] for p in SCRIPTS if "setup" in _functions(p)}
    assert set(SETUP_VARIANTS) <= set(with_setup), "a listed variant no longer has a setup()"
    for name, setup in with_setup.items():
        if name in SETUP_VARIANTS:
            assert _device_block(setup) == _device_block(reference), (
                f"{name}: the device/backend choice differs"
            )
        else:
            assert ast.dump(setup) == ast.dump(reference), (
                f"{name}: setup() differs from 00_hello.py's; make them equal or list why in SETUP_VARIANTS"
            )
    joins = {
        p.name: ast.dump(_functions(p)["join_process_group"])
        for p in SCRIPTS
        if "join_process_group" in _functions(p)
    }
    assert {"05_elastic.py", "06_train.py", "08_train.py"} <= set(joins) and len(set(joins.values())) == 1, (
        f"the copies of join_process_group differ: {sorted(joins)}"
    )
    scripts = REPO / "notebooks" / "scripts"
    reports = {ast.dump(_functions(scripts / name)["report"]) for name in ("05_launch.py", "05_elastic.py")}
    assert len(reports) == 1, "the copies of report() (one record, one write) in 05's scripts differ"
    saves = {
        p.name: ast.dump(_functions(p)["save_atomically"])
        for p in SCRIPTS
        if "save_atomically" in _functions(p)
    }
    assert {"01_checkpoints.py", "06_train.py", "08_train.py"} <= set(saves) and len(
        set(saves.values())
    ) == 1, f"the copies of save_atomically differ: {sorted(saves)}"


def test_choose_backend_applies_the_scripts_own_rule():
    """environment.choose_backend answers for the scripts: its backend expression is theirs, node for node."""

    def rule(function: ast.FunctionDef) -> str:
        return next(
            ast.dump(s.value)
            for s in function.body
            if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "backend"
        )

    scripts = {rule(_functions(p)["setup"]) for p in SCRIPTS if "setup" in _functions(p)}
    assert scripts == {rule(_functions(REPO / "ddp_helpers" / "environment.py")["choose_backend"])}, scripts


def test_the_launch_protocol_is_spelled_only_in_its_module():
    protocol = (REPO / "ddp_helpers" / "_protocol.py").read_text()
    for path in sorted((REPO / "ddp_helpers").glob("*.py")):
        if path.name == "_protocol.py":
            continue
        text = path.read_text()
        for pattern in (r"DDP_HELPERS_\w+", r"rank\{\w+\}\.", r"agent\{\w+\}\.", r"SIGUSR1"):
            found = re.findall(pattern, text)
            assert not found, f"{path.name} spells {found}: use the names in ddp_helpers/_protocol.py"
    assert "RUN_DIR" in protocol and "STACK_SIGNAL" in protocol


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_of_the_package_uses_a_private_name_of_another():
    """What one module of ddp_helpers/ takes from another has a public name (a module named ``_x`` may hold
    public names: ``_procs.is_alive``): ``from ddp_helpers.m import _y`` and ``m._y`` are refused."""
    package = REPO / "ddp_helpers"
    modules = {path.stem for path in package.glob("*.py")}
    found = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {}  # local name -> the package's module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("ddp_helpers.") and alias.asname:
                        imported[alias.asname] = alias.name.removeprefix("ddp_helpers.")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ddp_helpers":
                for alias in node.names:
                    if node.module == "ddp_helpers" and alias.name in modules:
                        imported[alias.asname or alias.name] = alias.name
                    elif _private(alias.name):
                        found.append(f"{path.name}:{node.lineno} from {node.module} import {alias.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                module = imported.get(node.value.id)
                if module is not None and module != path.stem and _private(node.attr):
                    found.append(f"{path.name}:{node.lineno} {module}.{node.attr}")
    assert not found, f"give these a public name in their module: {found}"


def test_the_launch_options_are_listed_in_one_place():
    """Only the taught signatures spell out the launch options (the IDE completion a reader sees); everything
    else takes one ``LaunchOptions``, so a new option is added in the dataclass and those four functions
    (``check()`` takes the subset of them that a check's run uses, and hands them to ``torchrun()``)."""
    import dataclasses

    from ddp_helpers.launcher import LaunchOptions

    options = {field.name for field in dataclasses.fields(LaunchOptions)}
    spelled = []

    def visit(node: ast.AST, prefix: str, path: Path) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = child.args.posonlyargs + child.args.args + child.args.kwonlyargs
                if len({a.arg for a in arguments} & options) >= 6:
                    spelled.append(f"{path.stem}.{prefix}{child.name}")
                visit(child, f"{prefix}{child.name}.", path)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", path)

    for path in sorted((REPO / "ddp_helpers").glob("*.py")):
        visit(ast.parse(path.read_text()), "", path)
    taught = ["checker.check", "launcher.torchrun", "ranks.RankGroup.__init__", "slurm.sbatch"]
    assert sorted(spelled) == taught, spelled


# Its two safety nets (300 s for the checks, 900 s for notebook 03 under nbmake) add up past the suite's
# 600 s: pytest-timeout sits above them, so that a failure shows which run ran out and what it printed.
@pytest.mark.timeout(1320)
def test_a_learners_saved_outputs_and_edits_do_not_fail_the_suite(tmp_path):
    """A learner runs a notebook in JupyterLab, edits a cell, saves: the checks pass, git's copy is clean."""
    # The project as git holds it (the staged copy, never this checkout's saved runs), in its own repository.
    exported = subprocess.run(
        ["git", "checkout-index", "--all", f"--prefix={tmp_path}/"], cwd=REPO, capture_output=True, text=True
    )
    if exported.returncode != 0:
        pytest.skip(f"not a git checkout: {exported.stderr.strip()}")

    def git(*args: str) -> str:
        command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "as committed")
    # What JupyterLab saves after Run All, plus an edited cell that was not re-run.
    target = tmp_path / "notebooks" / "03_sync_batchnorm.ipynb"
    nb = nbformat.read(target, as_version=4)
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = i + 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"[rank 0] output {i}\n")]
    writefile = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith("%%writefile"))
    writefile.source += "\n# my own note, not yet written to the script\n"
    nbformat.write(nb, target)
    assert git("status", "--porcelain").strip() == "M notebooks/03_sync_batchnorm.ipynb"
    checks = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "tests/test_project.py",
            "-k",
            "committed or writefile or parses",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert checks.returncode == 0, checks.stdout[-3000:]
    # safety net only
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",  # nbmake, as the README's
            "-n",
            "0",  # one notebook: no workers to start
            "notebooks/03_sync_batchnorm.ipynb",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    staged = nbformat.reads(git("show", ":notebooks/03_sync_batchnorm.ipynb"), as_version=4)
    assert all(c.outputs == [] and c.execution_count is None for c in staged.cells if c.cell_type == "code")
    assert git("diff", "--cached", "--stat") == "", "nothing was staged behind the learner's back"


OPEN_COMMANDS = {
    "English": ("README.md", "open-command", "notebooks/00_quickstart.ipynb"),
    "Chinese": ("README.zh-CN.md", "open-command-zh", "notebooks/zh-CN/00_quickstart.ipynb"),
}


def test_the_chinese_open_command_differs_only_in_its_notebook():
    english, chinese = _readme_block("open-command"), _readme_block("open-command-zh", "README.zh-CN.md")
    assert chinese == english.replace(
        "notebooks/00_quickstart.ipynb", "notebooks/zh-CN/00_quickstart.ipynb"
    ), chinese
    assert (REPO / "notebooks" / "zh-CN" / "00_quickstart.ipynb").is_file()


@pytest.mark.parametrize("language", OPEN_COMMANDS)
def test_the_open_commands_printed_address_opens_notebook_00(language):
    """Start JupyterLab as the README's open command does and follow the address it prints."""
    import time
    import urllib.error
    import urllib.request

    readme, marker, notebook = OPEN_COMMANDS[language]
    launch = _readme_block(marker, readme).split("&&")[-1].split()
    assert launch[:2] == [".venv/bin/jupyter", "lab"], launch
    # no fixed port
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        *launch[2:],
        "--no-browser",
        "--ServerApp.port=0",
    ]
    server = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        for line in server.stderr:  # JupyterLab prints its address once it listens
            if m := re.search(r"(http://127\.0\.0\.1:\d+/\S+)", line):
                address = m[1]
                break
        else:
            pytest.fail("JupyterLab exited without printing an address")
        assert f"/lab/tree/{notebook}?token=" in address, address
        for _ in range(600):  # the address is printed just before the server answers: retry until it does
            try:
                with urllib.request.urlopen(address, timeout=60) as page:
                    assert page.status == 200 and "JupyterLab" in page.read().decode(), address
                break
            except urllib.error.URLError as err:
                if not isinstance(err.reason, ConnectionRefusedError):
                    raise
                assert server.poll() is None, "JupyterLab exited"
                time.sleep(0.1)
        else:
            pytest.fail(f"JupyterLab never answered at {address}")
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


SOLUTIONS = sorted((REPO / "notebooks" / "solutions").glob("*.ipynb"))


def _exercise_count(nb_path: Path) -> int:
    """How many numbered exercises a notebook's Exercises section lists ("1. **Title.**" ...)."""
    text = "\n".join(
        c.source
        for c in nbformat.reads(committed_text(nb_path), as_version=4).cells
        if c.cell_type == "markdown"
    )
    section = text[text.index("## Exercises") :]
    return len(re.findall(r"^\d+\. \*\*", section, re.M))


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_exercise_has_a_solution_that_ci_runs(nb_path):
    solution = REPO / "notebooks" / "solutions" / f"{nb_path.stem}_solutions.ipynb"
    assert solution in SOLUTIONS, f"{nb_path.name} has exercises but no {solution.relative_to(REPO)}"
    count = _exercise_count(nb_path)
    cells = nbformat.reads(committed_text(solution), as_version=4).cells
    headings = [
        m
        for c in cells
        if c.cell_type == "markdown"
        for m in re.findall(r"^## Exercise (\d+)", c.source, re.M)
    ]
    assert headings == [str(k) for k in range(1, count + 1)], (nb_path.name, count, headings)
    exercises = next(
        c.source
        for c in nbformat.reads(committed_text(nb_path), as_version=4).cells
        if c.cell_type == "markdown" and "## Exercises" in c.source
    )
    assert f"solutions/{solution.name}" in exercises, (
        f"{nb_path.name}'s Exercises section should point to its solutions"
    )


@pytest.mark.parametrize("nb_path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_notebooks_are_committed_clean_and_parse(nb_path):
    nb = nbformat.reads(committed_text(nb_path), as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "strip outputs before committing"
            compile(_python_of_cell(cell.source), nb_path.name, "exec")
            assert (
                "%%writefile scripts/" not in cell.source or "%%writefile scripts/solutions/" in cell.source
            ), "solutions write their own scripts (scripts/solutions/), never the series' scripts"
