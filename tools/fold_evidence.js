// The site's notebook pages: the code of a cell tagged "evidence" (an exhaustive check a first reading may
// skip) is folded under a summary line, as JupyterLab shows it collapsed; its output stays in view.
// Idempotent: a page that runs this twice (the theme may load extra scripts again) still folds each cell once.
document.addEventListener("DOMContentLoaded", () => {
  const chinese = location.pathname.includes("/zh-CN/");
  for (const cell of document.querySelectorAll(".jp-Cell.celltag_evidence")) {
    const input = cell.querySelector(":scope > .jp-Cell-inputWrapper");
    if (!input) continue;
    const fold = document.createElement("details");
    fold.className = "evidence";
    const summary = document.createElement("summary");
    summary.textContent = chinese ? "证据：点击展开代码" : "Evidence: click to show the code";
    input.replaceWith(fold);
    fold.append(summary, input);
  }
});
