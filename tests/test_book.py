"""docs/book.py, the five chapters as HTML pages: nothing of the code lost, the main text open and
every appendix folded, headings as whole sentences, ``x`` as code, each citation linked to its
paper's entry, a page for the machinery's modules, the pages readable offline in a real browser
(where Chromium is installed)."""

import ast
import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
import book

ROOT = book.ROOT


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    out = tmp_path_factory.mktemp("book")
    assert book.main(["--out", str(out)]) == 0
    return out


def text_of(page):
    """The page's text as a reader sees it: tags dropped, entities read."""
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def shown(line):
    """A line of prose as the page shows its words: ``x`` is code, without its backticks."""
    return line.replace("``", "")


def prose_of(page):
    """The page without its code: the docstring, the headings and the prose beside the code."""
    return re.sub(r'<div class="code">.*?</div></div>', "", page, flags=re.S)


def source(name):
    return (ROOT / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", book.CHAPTERS)
def test_a_chapter_splits_into_pieces_that_join_back_to_it_exactly(name):
    assert book.source_of(*book.chapter(source(name))) == source(name)


@pytest.mark.parametrize("name", book.CHAPTERS)
def test_a_page_holds_every_line_the_main_text_open_and_every_appendix_folded(pages, name):
    page = (pages / f"{name}.html").read_text(encoding="utf-8")
    seen, at = text_of(page), 0
    # Every line in order: code as written, a comment as its words.
    for line in source(name).split("\n"):
        if not line.strip() or book.RULE.match(line):
            continue
        words = shown(line).strip().lstrip("#").strip()
        # Prose: its words, maybe joined with others.
        if line.lstrip().startswith("#") and not line.startswith(" "):
            assert all(w in seen for w in words.split()), (name, line)
            continue
        found = seen.find(line.strip(), at)
        if found < 0:  # A line of the docstring, its ``x`` shown as code.
            found = seen.find(shown(line).strip(), at)
        assert found >= 0, (name, line)
        at = found
    main, appendices = book.contents(source(name))
    # The main text has sections; a chapter may have no appendix (then nothing is folded).
    assert main
    opened = page.index("<details>") if appendices else len(page)
    headings = [text_of(h) for h in re.findall(r"<h2>(.*?)</h2>", page[:opened])]
    # The main text: before the first fold, each section under its heading.
    for title in main:
        assert shown(title) in headings, title
    folds = re.findall(r"<details>(.*?)</details>", page, flags=re.S)
    assert len(folds) == len(appendices) and "<details open" not in page
    for title, fold in zip(appendices, folds, strict=True):
        summary = re.match(r"<summary>(.*?)</summary>", fold)
        assert summary and text_of(summary.group(1)) == shown(title), title


@pytest.mark.parametrize("name", book.CHAPTERS)
def test_every_section_heading_is_a_whole_sentence_ending_with_a_period(name):
    """The line after a section's opening rule is its heading: one line, ending with a period."""
    _, sections = book.chapter(source(name))
    headings = [s["head"][1] for s in sections if s["head"]]
    assert headings
    unfinished = [h for h in headings if not (h.startswith("# ") and h.rstrip().endswith("."))]
    assert not unfinished, f"{name}: headings that do not end with a period: {unfinished}"


def test_the_index_gives_the_reading_order_and_each_chapters_contents(pages):
    index = (pages / "index.html").read_text(encoding="utf-8")
    assert re.findall(r'href="(\w+\.py)\.html"', index) == book.CHAPTERS
    seen = text_of(index)
    for name in book.CHAPTERS:
        for title in sum(book.contents(source(name)), []):
            assert shown(title) in seen, title
    assert "<script" not in index and all(
        "<script" not in p.read_text() for p in pages.glob("*.html")
    )


def test_the_pages_work_offline_with_no_javascript(pages):
    for p in pages.glob("*.html"):
        page = p.read_text(encoding="utf-8")
        for fetched in ("<script", "<link", "<img", "<iframe", " src=", "@import", "url("):
            assert fetched not in page, (p.name, fetched)
        assert not re.search(r'href="(https?:)?//', page), p.name


def test_the_machinery_page_lists_every_module_with_its_docstrings_first_line(pages):
    index = (pages / "index.html").read_text(encoding="utf-8")
    assert f'href="{book.PACKAGE_PAGE}"' in index
    page = (pages / book.PACKAGE_PAGE).read_text(encoding="utf-8")
    listed = re.findall(r'<section id="[^"]*">\n<h2>(.*?)</h2>(.*?)</section>', page, flags=re.S)
    paths = sorted(p for p in (ROOT / "machinery").glob("*.py") if p.name != "__init__.py")
    assert paths and [name for name, _ in listed] == [f"machinery/{p.name}" for p in paths]
    # Each module's docstring under its heading, its first line as written (``x`` as code).
    for p, (_, body) in zip(paths, listed, strict=True):
        doc = ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))
        assert doc, f"{p.name} has no docstring"
        first = shown(doc.split("\n")[0]).strip()
        assert first in text_of(body), (p.name, first)


def test_double_backticks_render_as_code():
    assert book.inline("run ``a < b`` now") == "run <code>a &lt; b</code> now"
    assert book.inline("``x`` and ``y``") == "<code>x</code> and <code>y</code>"


@pytest.mark.parametrize("name", book.CHAPTERS)
def test_a_pages_prose_shows_every_double_backtick_as_code(pages, name):
    page = (pages / f"{name}.html").read_text(encoding="utf-8")
    assert "``" not in prose_of(page), name
    intro, _ = book.chapter(source(name))
    for line in intro:
        for code in re.findall(r"``(.+?)``", line):
            assert f"<code>{html.escape(code, quote=False)}</code>" in page, (name, code)
    machinery = (pages / book.PACKAGE_PAGE).read_text(encoding="utf-8")
    assert "``" not in machinery


def test_a_citation_links_its_numbers_and_not_an_index():
    refs = {1: "#ref-1", 8: "#ref-8", 9: "#ref-9"}
    assert book.inline("x[1] and [1, eq. 5] and [8, 9]; [1 appendix A] [4]", refs) == (
        'x[1] and [<a href="#ref-1">1</a>, eq. 5] and '
        '[<a href="#ref-8">8</a>, <a href="#ref-9">9</a>]; '
        '[<a href="#ref-1">1</a> appendix A] [4]'
    )


def test_every_citation_links_to_an_existing_entry(pages):
    ids = {
        p.name: set(re.findall(r'id="(ref-\d+)"', p.read_text(encoding="utf-8")))
        for p in pages.glob("*.html")
    }
    index = (pages / "index.html").read_text(encoding="utf-8")
    # The index lists every paper a chapter lists, as that chapter's own list gives it.
    for name in book.CHAPTERS:
        intro, _ = book.chapter(source(name))
        own = book.references(intro)
        assert own, f"{name} lists no papers"
        assert {f"ref-{n}" for n in own} <= ids[f"{name}.html"] & ids["index.html"], name
    assert all(f'<li id="ref-{n}">[{n}] ' in index for n in (1, 2, 3))
    links = 0
    for p in pages.glob("*.html"):
        page = p.read_text(encoding="utf-8")
        for target, anchor in re.findall(r'href="([^"#]*)#(ref-\d+)"', page):
            assert anchor in ids[target or p.name], (p.name, target, anchor)
            links += 1
        # No citation of a listed paper is left unlinked in the prose.
        everyone = {int(i[4:]) for i in ids["index.html"]}
        for m in book.CITE.finditer(prose_of(page)):
            numbers = {int(n) for n in re.findall(r"\d+", m.group(1))}
            assert not numbers & everyone, (p.name, m.group())
    assert links > 100


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="needs Chromium (Debian's package chromium)"
)
def test_chromium_renders_the_index_and_a_chapter(pages, tmp_path):
    """The screenshots committed as assets/book-index.png and assets/book-norms.png are these."""
    for page, png in (("index.html", "book-index.png"), ("norms.py.html", "book-norms.png")):
        subprocess.run(
            [
                "chromium",
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={tmp_path / 'profile'}",
                "--window-size=1400,1000",
                f"--screenshot={tmp_path / png}",
                (pages / page).as_uri(),
            ],
            capture_output=True,
            timeout=120,
            check=True,
        )
        shot = (tmp_path / png).read_bytes()
        assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20000
