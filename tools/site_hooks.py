"""mkdocs hook (tools/build_site.py names it): a notebook heading's id on the site keeps the letters of any
script. mkdocs-jupyter's slug keeps ASCII only: a Chinese heading got an empty id, and no link reached it."""

from __future__ import annotations

import re
import unicodedata

import mkdocs_jupyter.convert
import mkdocs_jupyter.plugin
import nbformat


def slugify(value: str) -> str:
    """A heading's id: lower case, word characters of any script kept, runs of spaces and dashes one "-"."""
    value = re.sub(r"[^\w\s-]", "", unicodedata.normalize("NFKC", value)).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


mkdocs_jupyter.convert.slugify = slugify  # what its heading renderer calls, by that module's name


def heading_id(line: str) -> str:
    """The id a Markdown heading line gets on a notebook's page (nbconvert's renderer, slug as above)."""
    from mkdocs_jupyter.nbconvert2 import custom_markdown2html

    found = re.search(r'id="([^"]*)"', custom_markdown2html(line))
    return found[1] if found else ""


def heading_lines(markdown: str) -> list[str]:
    """The ATX heading lines of ``markdown``, in order, outside fenced blocks."""
    lines, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            lines.append(line)
    return lines


def toc_with_page_ids(fpath: str, toc_depth: int) -> tuple[list[dict], str | None]:
    """mkdocs-jupyter's table of contents for a notebook, each entry's id the one its heading has on the page:
    the plugin slugs a copy without inline code or other scripts, the page its HTML: they differed."""
    tokens, title = nb_toc_tokens(fpath, toc_depth)
    flat, todo = [], list(tokens)
    while todo:  # the entries in document order: depth first
        token = todo.pop(0)
        flat.append(token)
        todo[:0] = token["children"]
    nb = nbformat.read(fpath, as_version=4)
    lines = [line for cell in nb.cells if cell.cell_type == "markdown" for line in heading_lines(cell.source)]
    if len(lines) == len(flat):  # else leave the plugin's own (the site's link test names what breaks)
        for token, line in zip(flat, lines, strict=True):
            token["id"] = heading_id(line)
    return tokens, title


# mkdocs-jupyter has no public hook for a page's TOC: its private function is wrapped.
nb_toc_tokens = mkdocs_jupyter.plugin._get_nb_toc_tokens
mkdocs_jupyter.plugin._get_nb_toc_tokens = toc_with_page_ids
