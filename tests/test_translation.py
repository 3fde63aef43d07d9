"""The Chinese edition (notebooks/zh-CN/) stays in step with the English one: same code, every notebook."""

from __future__ import annotations

import re

import nbformat
import pytest
from ddp_test_support import REPO, committed_text

EN = sorted((REPO / "notebooks").glob("*.ipynb")) + sorted((REPO / "notebooks" / "solutions").glob("*.ipynb"))
ZH = REPO / "notebooks" / "zh-CN"
CJK = re.compile(r"[\u4e00-\u9fff]")


def _twin(en) -> object:
    return ZH / en.relative_to(REPO / "notebooks")


def _cells(path) -> list:
    return nbformat.reads(committed_text(path), as_version=4).cells


@pytest.mark.parametrize("en", EN, ids=lambda p: p.relative_to(REPO / "notebooks").as_posix())
def test_every_notebook_has_a_chinese_twin_with_the_same_code(en):
    zh = _twin(en)
    assert zh.is_file(), f"no Chinese twin {zh.relative_to(REPO)} for {en.name}"
    en_code = [c.source for c in _cells(en) if c.cell_type == "code"]
    zh_code = [c.source for c in _cells(zh) if c.cell_type == "code"]
    assert len(zh_code) == len(en_code), (len(zh_code), len(en_code))
    for i, (a, b) in enumerate(zip(en_code, zh_code, strict=True)):
        assert a == b, f"code cell {i} of {zh.name} differs from the English one:\n{b[:300]}\n---\n{a[:300]}"


@pytest.mark.parametrize("en", EN, ids=lambda p: p.relative_to(REPO / "notebooks").as_posix())
def test_the_chinese_twin_is_clean_and_written_in_chinese(en):
    zh = _twin(en)
    if not zh.is_file():
        pytest.fail(f"no Chinese twin {zh.relative_to(REPO)}")
    cells = _cells(zh)
    for cell in cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "strip outputs before committing"
    prose = [
        c.source
        for c in cells
        if c.cell_type == "markdown" and len(re.sub(r"```.*?```", "", c.source, flags=re.S)) > 40
    ]
    untranslated = [p[:80] for p in prose if not CJK.search(re.sub(r"```.*?```", "", p, flags=re.S))]
    assert not untranslated, f"{zh.name}: markdown cells without Chinese: {untranslated}"


def test_glossary_and_chinese_readme():
    glossary = (ZH / "术语表.md").read_text()
    for term in (
        "rank",
        "local rank",
        "world size",
        "process group",
        "collective",
        "all-reduce",
        "sampler",
        "padding",
        "bucket",
        "elastic restart",
    ):
        assert f"| {term}" in glossary, f"the glossary lacks {term!r}"
    zh_readme = (REPO / "README.zh-CN.md").read_text()
    en_readme = (REPO / "README.md").read_text()
    assert "README.zh-CN.md" in en_readme.split("\n## ")[0], (
        "README.md should link the Chinese one at its top"
    )
    assert "README.md" in zh_readme.split("\n## ")[0], (
        "README.zh-CN.md should link the English one at its top"
    )
    for marker in ("open-command", "test-command", "site-command"):
        block = re.search(rf"<!-- {marker} -->.*?<!-- /{marker} -->", en_readme, re.S)[0]
        assert block in zh_readme, f"README.zh-CN.md must give the same {marker} as README.md"
    for nb in sorted(ZH.glob("*.ipynb")):
        assert f"notebooks/zh-CN/{nb.name}" in zh_readme, f"README.zh-CN.md's table lacks {nb.name}"
    assert "jupyterlab-language-pack-zh-CN" in zh_readme
