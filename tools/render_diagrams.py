"""Render the notebooks' diagrams (notebooks/images/*.mmd, mermaid) to SVG files, which are committed.

Not part of the build or the tests: the SVGs show in JupyterLab, on GitHub and on the site without any
script or network. To change a diagram, edit its .mmd, get mermaid.js (`npm install mermaid@11`), and run
    python tools/render_diagrams.py node_modules/mermaid/dist/mermaid.min.js \
        notebooks/images/00_pattern.mmd notebooks/images/00_pattern.svg [more .mmd .svg pairs]
It drives Debian's Chromium through Playwright, as the browser tests do.
"""

import os
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

mermaid_js = Path(sys.argv[1]).read_text()
for src, out in zip(sys.argv[2::2], sys.argv[3::2], strict=True):
    text = Path(src).read_text()
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=os.environ.get("DDP_CHROMIUM", "/usr/bin/chromium"), args=["--no-sandbox"]
        )
        page = b.new_page()
        page.set_content("<html><body></body></html>")
        page.add_script_tag(content=mermaid_js)
        svg = page.evaluate(
            """async (text) => {
            mermaid.initialize({startOnLoad: false, theme: "default", htmlLabels: false,
                                flowchart: {htmlLabels: false}});
            const {svg} = await mermaid.render("diagram", text);
            return svg;
        }""",
            text,
        )
        b.close()
    Path(out).write_text(svg)
    print(out, len(svg))
