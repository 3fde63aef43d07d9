"""Every claim a notebook asserts says what was seen when it fails.

A bare ``assert`` fails under nbmake as ``AssertionError:`` and nothing else, so when a new PyTorch
breaks a claim nobody can tell what the cell observed. Each ``assert`` in a code cell must carry a
message (the expression after the comma) showing the value(s) it tested. ``%%writefile`` cells are
scripts, not claims of the notebook, and are left out.
"""

from __future__ import annotations

import ast

import nbformat
import pytest
from ddp_test_support import REPO, committed_text

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb")) + sorted(
    (REPO / "notebooks" / "solutions").glob("*.ipynb")
)


def bare_asserts(nb: nbformat.NotebookNode) -> list[str]:
    """``cell <id>, line <n>: assert ...`` for each assert without a message in the notebook's code cells."""
    from IPython.core.inputtransformer2 import TransformerManager

    transformer = TransformerManager()  # cells hold %magics and !commands: turn them into Python first
    found = []
    for cell in nb.cells:
        if cell.cell_type != "code" or cell.source.startswith("%%writefile"):
            continue
        tree = ast.parse(transformer.transform_cell(cell.source))
        bare = [n for n in ast.walk(tree) if isinstance(n, ast.Assert) and n.msg is None]
        for node in sorted(bare, key=lambda n: n.lineno):
            found.append(f"cell {cell.get('id', '?')}, line {node.lineno}: {ast.unparse(node)[:100]}")
    return found


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_assert_in_a_code_cell_has_a_message(nb_path):
    bare = bare_asserts(nbformat.reads(committed_text(nb_path), as_version=4))  # what git holds
    assert not bare, (
        f"{nb_path.name}: {len(bare)} assert(s) without a message showing what was seen:\n" + "\n".join(bare)
    )
