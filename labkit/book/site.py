"""The cookbook as a static site, built from the stored chapters: ``make book``, or

    python -m labkit.book.site [OUT]          # default build/book; open OUT/index.html

Nothing is executed: each page shows what its notebook stores (outputs recorded by
``python -m labkit record``, with the device and commit stamped in its metadata, which the
page's provenance line shows), or where a GPU executed the chapter's current code, what it
showed there (:mod:`labkit.book.gpu_copies`). The tool is nbconvert's ``lab`` template, which
JupyterLab already installs, with its script blocks emptied: the template would load
require.js, MathJax, mermaid and the widget manager from CDNs, and the chapters need none of
them (no math, no diagrams, widgets stored as their final text by ``record``). Its CSS uses
system fonts. So a page fetches nothing, at build time or when read. The index is the README's
chapter table; each page links to the previous and next chapter and back to the index.
"""
from __future__ import annotations

import html
import re
import sys
import time
from pathlib import Path

from .gpu_copies import GPU_COPIES, gpu_copy, provenance, shown

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
#: a row of the README's chapter table: ``| [00_name](notebooks/00_name.ipynb) | question |``
_ROW = re.compile(r"^\| \[(\w+)\]\(notebooks/(\w+)\.ipynb\) \| (.+) \|$", re.M)

_CSS = """
main { max-width: 1100px; margin: 0 auto; padding: 0 16px 48px; }
.book-nav { display: flex; justify-content: space-between; gap: 16px; margin: 16px 0;
            font-family: var(--jp-ui-font-family); font-size: 14px; }
.book-nav a { color: var(--jp-content-link-color, #1a6fb5); text-decoration: none; }
.book-provenance { font-family: var(--jp-ui-font-family); font-size: 13px;
                   color: var(--jp-ui-font-color2, #666); margin: 8px 0 16px; }
/* a long line scrolls in its own box, never wider than the page, never clipped */
.jp-InputArea, .jp-InputArea-editor { overflow-x: auto; }
.jp-OutputArea-output, .jp-RenderedText { overflow-x: auto; max-width: 100%; }
/* output lines as printed: the lab theme breaks them anywhere, mid-word included */
.jp-OutputArea-output pre { white-space: pre; word-break: normal; }
.jp-RenderedHTMLCommon table { display: block; overflow-x: auto; max-width: 100%; }
.jp-RenderedImage img { max-width: 100%; height: auto; }
"""

_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block html_head_css -%}
<style type="text/css">{{ resources.book.css }}</style>
{%- endblock html_head_css -%}
{%- block body_header -%}
{{ super() }}
{{ resources.book.nav }}
<p class="book-provenance">{{ resources.book.provenance }}</p>
{%- endblock body_header -%}
{%- block body_footer -%}
{{ resources.book.nav }}
{{ super() }}
{%- endblock body_footer -%}
"""


def chapters(readme: Path = ROOT / "README.md") -> list[tuple[str, str]]:
    """(notebook stem, the question it answers) for each row of the README's chapter table."""
    rows = [(stem, question) for _, stem, question in _ROW.findall(readme.read_text())]
    if not rows:
        raise ValueError(f"{readme}: no chapter table (rows like | [00_x](notebooks/00_x.ipynb) "
                         "| question |)")
    return rows


def _inline(markdown: str) -> str:
    """The README's table cell as HTML: escaped, with its `code` spans."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(markdown, quote=False))


def title(nb: dict, stem: str) -> str:
    """A chapter's title: its first ``# `` heading, less a trailing parenthesis and code marks
    (``# 01 — The Python loop (stage 0, `python_loop`)`` -> ``01 — The Python loop``); else
    its file name's words."""
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            for line in "".join(cell.get("source", "")).splitlines():
                if line.startswith("# "):
                    return re.sub(r"\s*\([^)]*\)$", "", line[2:]).replace("`", "").strip()
    number, _, words = stem.partition("_")
    return f"{number} — {words.replace('_', ' ').capitalize()}"


def _nav(stems: list[str], titles: dict[str, str], i: int) -> str:
    link = '<a href="{}.html">{}</a>'
    prev = link.format(stems[i - 1], f"← {html.escape(titles[stems[i - 1]])}") if i > 0 \
        else "<span></span>"
    nxt = link.format(stems[i + 1], f"{html.escape(titles[stems[i + 1]])} →") \
        if i + 1 < len(stems) else "<span></span>"
    return f'<nav class="book-nav">{prev}<a href="index.html">Contents</a>{nxt}</nav>'


def _index(rows: list[tuple[str, str]], titles: dict[str, str]) -> str:
    items = "\n".join(f'<tr><td><a href="{stem}.html">{html.escape(titles[stem])}</a></td>'
                      f"<td>{_inline(question)}</td></tr>" for stem, question in rows)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<title>labkit: the cookbook</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1000px; margin: 0 auto; padding: 24px;
       line-height: 1.5; color: #222; }}
table {{ border-collapse: collapse; width: 100%; }}
td {{ border-top: 1px solid #ddd; padding: 8px; vertical-align: top; }}
td:first-child {{ white-space: nowrap; }}
a {{ color: #1a6fb5; text-decoration: none; }}
code {{ font-family: ui-monospace, monospace; font-size: 90%; }}
</style></head>
<body>
<h1>labkit: a PPO training loop, from a Python loop to a GPU-native pipeline</h1>
<p>{len(rows)} chapters, each timed live where it was recorded. Every page shows the outputs
its notebook stores; run a chapter yourself with <code>make lab</code>.</p>
<table>
{items}
</table>
</body></html>
"""


def build(out: Path, notebooks: Path = NOTEBOOKS, readme: Path = ROOT / "README.md",
          gpu_copies: Path = GPU_COPIES) -> list[Path]:
    """Write the index and one page per chapter into ``out``; return the pages written. A
    chapter with a current GPU copy in ``gpu_copies`` shows its GPU outputs
    (:mod:`labkit.book.gpu_copies`); a stale copy is named on the page, its outputs not shown."""
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter

    rows = chapters(readme)
    stems = [stem for stem, _ in rows]
    exporter = HTMLExporter(template_name="lab", template_file="book.html.j2",
                            extra_loaders=[jinja2.DictLoader({"book.html.j2": _TEMPLATE})])
    out.mkdir(parents=True, exist_ok=True)
    nbs = {stem: nbformat.read(notebooks / f"{stem}.ipynb", as_version=4) for stem in stems}
    titles = {stem: title(nb, stem) for stem, nb in nbs.items()}
    pages = []
    for i, stem in enumerate(stems):
        copy = gpu_copy(nbs[stem], gpu_copies / f"{stem}.ipynb")
        nb = shown(nbs[stem], copy)
        nb.metadata["title"] = f"{titles[stem]} · labkit"
        body, _ = exporter.from_notebook_node(nb, resources={"book": {
            "css": _CSS, "nav": _nav(stems, titles, i),
            "provenance": provenance(nbs[stem], copy)}})
        # links between chapters point at their pages
        body = re.sub(r'href="(?:\./)?(\d\d_\w+)\.ipynb', r'href="\1.html', body)
        page = out / f"{stem}.html"
        page.write_text(body, encoding="utf-8")
        pages.append(page)
    (out / "index.html").write_text(_index(rows, titles), encoding="utf-8")
    return [out / "index.html", *pages]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else ROOT / "build" / "book"
    start = time.perf_counter()
    pages = build(out)
    print(f"wrote {len(pages)} pages to {out} in {time.perf_counter() - start:.1f} s; "
          f"open {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
