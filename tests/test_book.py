"""``make book``: the site built from the stored chapters, opened page by page in headless
Chromium (Debian's, through Playwright, never a downloaded browser) and checked for what a
reader sees. Screenshots go to ``build/book-screenshots/`` for a person to look at."""
from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from labkit.book import site

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "build" / "book-screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
INSTALL = "apt-get install chromium (as root; make test does it where it may)"


def _browser_or_skip():
    """Playwright and Debian's Chromium, or a skip naming the install line; under CI=true
    their absence fails."""
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "playwright (pip install -e '.[book]')"
    if missing is None and CHROMIUM is None:
        missing = f"chromium: {INSTALL}"
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the book's browser test needs {missing}")
        pytest.skip(f"needs {missing}")
    return sync_playwright


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The site, built into a temporary folder and served on 127.0.0.1 (a free port)."""
    out = tmp_path_factory.mktemp("book")
    site.build(out)
    handler = functools.partial(_QuietHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield out, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # noqa: D401 - the test's output stays readable
        pass


@pytest.mark.slow
def test_the_site_is_built_from_every_chapter_in_the_readme(served):
    out, _ = served
    stems = [stem for stem, _ in site.chapters()]
    assert stems == sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert all((out / f"{stem}.html").stat().st_size > 0 for stem in stems)
    text = (out / "index.html").read_text()
    assert all(f'href="{stem}.html"' in text for stem in stems)
    import nbformat  # here, not at the top: it costs the fast tier seconds (jsonschema)

    titles = [site.title(nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4), stem)
              for stem in stems]  # each chapter by its own heading
    assert all(t in text and "(" not in t and "`" not in t for t in titles)
    assert f"<p>{len(stems)} chapters" in text
    for page in out.glob("*.html"):  # nothing to fetch from elsewhere, written or linked
        assert not re.search(r'(?:src|href)="(?:https?:)?//', page.read_text()), page.name


#: The most lines one stored output may have: about a screen. A longer report is split (one
#: case per cell) or shown briefly (``show.source(obj, brief=True)``), with details a flag away.
WALL = 60


def test_no_stored_output_is_a_wall():
    walls = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]  # nbformat 4, read as the JSON it is
        for i, cell in enumerate(cells):
            for out in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
                text = out.get("text") or out.get("data", {}).get("text/plain", "")
                text = "".join(text) if isinstance(text, list) else text
                page = out.get("data", {}).get("text/html", "")
                page = "".join(page) if isinstance(page, list) else page
                # a text output, or each listing of an HTML one (side_by_side's columns)
                for block in [text, *re.findall(r"(?s)<pre[^>]*>(.*?)</pre>", page)]:
                    if len(block.splitlines()) > WALL:
                        walls.append(f"{path.stem} c{i}: {len(block.splitlines())} lines")
    assert not walls, walls


def _expected(stem: str) -> dict:
    """What the page must show: the notebook's code cells, image outputs, and a line of each
    text output (its first non-blank line, whitespace collapsed)."""
    import nbformat

    from labkit.book.gpu_copies import GPU_COPIES, gpu_copy, shown

    chapter = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
    nb = shown(chapter, gpu_copy(chapter, GPU_COPIES / f"{stem}.ipynb"))  # a GPU's outputs
    code = [c for c in nb.cells if c.cell_type == "code"]
    images, lines = 0, []
    for cell in code:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            images += sum(1 for k in data if k.startswith("image/"))
            text = out.get("text") or (data.get("text/plain") if not any(
                k in data for k in ("text/html", "image/png", "text/markdown")) else None)
            if isinstance(text, list):
                text = "".join(text)
            first = next((ln for ln in (text or "").splitlines() if ln.strip()), None)
            if first and not re.search(r"\x1b\[", first):
                lines.append(" ".join(first.split())[:80])
    return {"code": len(code), "images": images, "lines": lines}


_MEASURE = """() => {
  const width = document.documentElement.clientWidth;
  const scrolls = (el) => {
    for (let e = el; e && e !== document.body; e = e.parentElement) {
      const o = getComputedStyle(e).overflowX;
      if ((o === 'auto' || o === 'scroll') && e.clientWidth <= width) return true;
    }
    return false;
  };
  const wide = [...document.querySelectorAll('pre, table')]
    .filter(e => e.scrollWidth > e.clientWidth + 1 || e.getBoundingClientRect().right > width + 1)
    .filter(e => !scrolls(e)).map(e => e.outerHTML.slice(0, 120));
  const broken = [...document.querySelectorAll('.jp-OutputArea-output pre')]
    .filter(e => getComputedStyle(e).wordBreak === 'break-all'
                 || getComputedStyle(e).whiteSpace !== 'pre').length;
  const blank = [...document.querySelectorAll('.jp-OutputArea-output')]
    .filter(e => !e.innerText.trim() && !e.querySelector('img, svg, canvas'))
    .map(e => e.outerHTML.slice(0, 120));
  return {
    pageWidth: document.documentElement.scrollWidth, width,
    code: document.querySelectorAll('.jp-CodeCell').length,
    images: document.querySelectorAll('.jp-OutputArea-output img').length,
    broken: [...document.images].filter(i => !i.complete || i.naturalWidth === 0).length,
    wide, blank, wrapped: broken, text: document.body.innerText.replace(/\\s+/g, ' '),
    links: [...document.querySelectorAll('a')].map(a => a.getAttribute('href')),
  };
}"""


@pytest.mark.slow
def test_every_page_shows_its_notebook_to_a_reader_in_chromium(served):
    """Each page loads with no console error and no request to another host; shows as many
    code cells and images as its notebook, every image loaded, each text output's first line;
    no code block or table wider than the page without its own scroll; output lines as
    printed (never broken mid-word); no blank output; every chapter reachable from the
    index."""
    sync_playwright = _browser_or_skip()
    out, base = served
    stems = [stem for stem, _ in site.chapters()]
    SHOTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        errors: list[str] = []
        foreign: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))

        def route(r):
            if r.request.url.startswith(base) or r.request.url.startswith("data:"):
                r.continue_()
            else:
                foreign.append(r.request.url)
                r.abort()

        page.route("**/*", route)
        page.goto(f"{base}/index.html", wait_until="load")
        index = page.evaluate(_MEASURE)
        reached = {h.removesuffix(".html") for h in index["links"] if h}
        missing = [s for s in stems if s not in reached]
        if missing:
            problems.append(f"index: no link to {missing}")
        for stem in stems:
            errors.clear()
            foreign.clear()
            page.goto(f"{base}/{stem}.html", wait_until="load")
            seen = page.evaluate(_MEASURE)
            page.screenshot(path=str(SHOTS / f"{stem}.png"), full_page=False)
            want = _expected(stem)
            where = f"{stem}:"
            if errors:
                problems.append(f"{where} console errors {errors[:3]}")
            if foreign:
                problems.append(f"{where} requests to other hosts {foreign[:3]}")
            if seen["code"] != want["code"]:
                problems.append(f"{where} {seen['code']} code cells shown, {want['code']} stored")
            if seen["images"] != want["images"] or seen["broken"]:
                problems.append(f"{where} {seen['images']} images shown ({seen['broken']} "
                                f"not loaded), {want['images']} stored")
            absent = [ln for ln in want["lines"] if ln not in seen["text"]]
            if absent:
                problems.append(f"{where} outputs not shown: {absent[:3]}")
            if seen["pageWidth"] > seen["width"] + 1 or seen["wide"]:
                problems.append(f"{where} wider than the page ({seen['pageWidth']} > "
                                f"{seen['width']}): {seen['wide'][:2]}")
            if seen["wrapped"]:
                problems.append(f"{where} {seen['wrapped']} outputs wrap their lines (mid-word)")
            if seen["blank"]:
                problems.append(f"{where} blank outputs {seen['blank'][:2]}")
            for neighbour in ("index.html",):
                if neighbour not in seen["links"]:
                    problems.append(f"{where} no link back to the index")
        browser.close()
    assert not problems, "\n".join(problems)


def _synthetic_gpu_book(tmp_path: Path, stale: bool = False) -> tuple[Path, str, str]:
    """A one-chapter book of chapter 09 with a synthetic GPU copy (what ``record --device
    cuda`` writes, its first output replaced by a marker): (the page, the marker, the CPU
    output the marker stands in for). ``stale``: the copy's code differs by one line."""
    import nbformat

    stem = "09_cuda_graphs"
    chapter = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
    copy = nbformat.from_dict(json.loads(json.dumps(chapter)))
    cell = next(c for c in copy.cells if c.cell_type == "code" and _expected_line(c))
    cpu_line = _expected_line(cell)
    marker = "GPU-SYNTHETIC one rollout step replayed in 315 us"
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=marker + "\n")]
    if stale:
        cell.source += "\n# edited after the GPU run"
    copy.metadata["labkit"] = {"device": "cuda", "device_name": "NVIDIA H200", "git_commit":
                               "abc1234def", "torch": "2.11.0+cu130", "date": "2026-11-26T09:03"}
    copies = tmp_path / "chapters_cuda"
    copies.mkdir()
    nbformat.write(copy, copies / f"{stem}.ipynb")
    readme = tmp_path / "README.md"
    readme.write_text(f"| [{stem}](notebooks/{stem}.ipynb) | What does a graph replay? |\n")
    site.build(tmp_path / "book", readme=readme, gpu_copies=copies)
    return tmp_path / "book" / f"{stem}.html", marker, cpu_line


def _expected_line(cell) -> str | None:
    for out in cell.get("outputs", []):
        text = out.get("text")
        if text:
            return next((ln for ln in text.splitlines() if ln.strip()), None)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("stale", [False, True], ids=["current", "stale"])
def test_a_gpu_copy_shows_its_outputs_where_its_code_is_the_chapters(tmp_path, stale):
    """A GPU copy whose code cells are the chapter's gives the page its outputs and its label
    (device, torch, commit, from the copy's stamp); one whose code changed is named stale and
    its outputs are never shown as the chapter's."""
    import html as html_module

    page, marker, cpu_line = _synthetic_gpu_book(tmp_path, stale)
    text = html_module.unescape(page.read_text())
    label = "NVIDIA H200 (cuda), torch 2.11.0+cu130, at commit abc1234def, 2026-11-26"
    if stale:
        assert marker not in text and html_module.unescape(cpu_line) in text
        assert f"Its GPU copy ({label}) is stale" in text
        assert "Outputs recorded on cpu" in text
    else:
        assert marker in text and html_module.unescape(cpu_line) not in text
        assert f"Outputs recorded on a GPU, {label}" in text
        assert "stale" not in text


@pytest.mark.slow
def test_a_gpu_copys_outputs_and_label_are_what_a_reader_sees_in_chromium(tmp_path):
    sync_playwright = _browser_or_skip()
    page_path, marker, _ = _synthetic_gpu_book(tmp_path)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(page_path.as_uri(), wait_until="load")
        said = page.inner_text(".book-provenance")
        shown = page.inner_text("body")
        browser.close()
    assert said.startswith("Outputs recorded on a GPU, NVIDIA H200 (cuda), torch 2.11.0+cu130")
    assert marker in shown
