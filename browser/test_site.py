"""The readable edition in a real browser: built from the executed notebooks, every page loads, every image
shows, no page logs an error, every internal link resolves, and the landing pages list every notebook."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _fetch(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


# The build waits for the notebooks that other pytest-xdist workers still run: a safety net far above that.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def site(free_port, notebooks_run_here):
    """Build the site as the README's site command does (from the notebooks this run executed); serve it."""
    # a safety net: it executes only notebooks the run did not
    built = subprocess.run(
        [sys.executable, "tools/build_site.py"], cwd=REPO, capture_output=True, text=True, timeout=3600
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "http.server",
            str(free_port),
            "--bind",
            "127.0.0.1",
            "--directory",
            str(REPO / "site"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{free_port}/"
    try:
        while _fetch_or_none(base) != 200:  # until the server answers
            assert server.poll() is None, "the static file server exited"
            time.sleep(0.1)
        yield base
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()


def _fetch_or_none(url: str) -> int | None:
    try:
        return _fetch(url)
    except (urllib.error.URLError, ConnectionError):
        return None


def test_every_page_loads_shows_its_images_and_links_only_to_what_exists(chromium, site):
    page = chromium.new_page()
    problems: list[str] = []
    page.on(
        "console",
        lambda m: problems.append(f"console error on {page.url}: {m.text}") if m.type == "error" else None,
    )
    page.on("pageerror", lambda e: problems.append(f"script error on {page.url}: {e}"))
    todo, seen, files = deque([site + "index.html"]), set(), set()
    ids: dict[str, set[str]] = {}  # page -> the ids on it, percent-decoded
    jumps: set[tuple[str, str, str]] = set()  # (from page, to page, fragment) of each link into a section
    while todo:
        url = todo.popleft()
        if url in seen:
            continue
        seen.add(url)
        response = page.goto(url, wait_until="load")
        if response is None or not response.ok:
            problems.append(f"{url}: HTTP {response.status if response else 'no response'}")
            continue
        broken = page.eval_on_selector_all(
            "img",
            "imgs => imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src.slice(0, 80))",
        )
        problems += [f"image that did not load on {url}: {src}" for src in broken]
        ids[url] = set(page.eval_on_selector_all("[id]", "els => els.map(e => decodeURIComponent(e.id))"))
        headings = page.eval_on_selector_all(
            ".md-content h1, .md-content h2, .md-content h3", "hs => hs.map(h => h.id + '|' + h.innerText)"
        )
        problems += [f"a heading without an id on {url}: {h[1:41]}" for h in headings if h.startswith("|")]
        for href in page.eval_on_selector_all("a[href]", "links => links.map(a => a.href)"):
            target, _, fragment = href.partition("#")
            if target.startswith(site):
                (todo.append(target) if target.endswith(".html") else files.add(target))
                if fragment and target.endswith(".html"):
                    jumps.add((url, target, urllib.parse.unquote(fragment)))
    problems += [f"broken link: {f}" for f in sorted(files) if _fetch(f) != 200]
    problems += [  # a link into a section lands on it: the heading's id on the target page exists
        f"link on {origin} to a section {target} lacks: #{fragment}"
        for origin, target, fragment in sorted(jumps)
        if target in ids and fragment not in ids[target]
    ]
    assert not problems, "\n".join(problems[:40])
    pages = {url.removeprefix(site) for url in seen}
    for nb in NOTEBOOKS:
        for language in ("", "zh-CN/"):
            assert f"notebooks/{language}{nb.stem}.html" in pages, f"no page for {language}{nb.name}"
    print(f"{len(seen)} pages and {len(files)} other files checked")


def test_the_landing_pages_list_every_notebook(chromium, site):
    page = chromium.new_page()
    for landing, folder in (("index.html", "notebooks/"), ("README.zh-CN.html", "notebooks/zh-CN/")):
        page.goto(site + landing)
        links = set(page.eval_on_selector_all("a[href]", "links => links.map(a => a.getAttribute('href'))"))
        missing = [nb.stem for nb in NOTEBOOKS if f"{folder}{nb.stem}.html" not in links]
        assert not missing, (landing, missing)


def test_evidence_cells_are_folded_and_open_on_a_click(chromium, site):
    page = chromium.new_page()
    page.goto(site + "notebooks/02_distributed_sampler.html", wait_until="load")
    folds = page.locator(".celltag_evidence details.evidence")
    assert folds.count() >= 1, "no folded evidence cell on 02's page"
    code = folds.first.locator(".jp-Cell-inputWrapper")
    assert not code.is_visible(), "an evidence cell's code shows before a click"
    folds.first.locator("summary").click()
    assert code.is_visible() and "assert" in code.inner_text(), "the click did not show the evidence's code"


def test_a_notebook_page_shows_the_ranks_output_and_switches_language(chromium, site):
    page = chromium.new_page()
    for url, other in (
        ("notebooks/00_start_here.html", "zh-CN/00_start_here.html"),
        ("notebooks/zh-CN/00_start_here.html", "../00_start_here.html"),
    ):
        page.goto(site + url)
        text = page.inner_text("body")
        assert "[rank 0]" in text and "[rank 1]" in text, f"{url} lacks the ranks' output"
        assert "rank 1 raised ValueError" in text, f"{url} lacks the crash the notebook provokes"
        hrefs = page.eval_on_selector_all("a[href]", "links => links.map(a => a.getAttribute('href'))")
        assert other in hrefs, f"{url} has no link to the other language"
        assert page.locator("a.md-footer__link--next").count() == 1, f"{url} has no link to the next page"
