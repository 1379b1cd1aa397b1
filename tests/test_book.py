"""docs/book.py, the five chapters as HTML pages: nothing of the code lost, the main text open and
every appendix folded, the pages readable in a real browser (where Chromium is installed)."""

import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))
import book  # noqa: E402


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    out = tmp_path_factory.mktemp("book")
    assert book.main(["--out", str(out)]) == 0
    return out


def text_of(page):  # the page's text as a reader sees it: tags dropped, entities read
    return html.unescape(re.sub(r"<[^>]+>", "", page))


@pytest.mark.parametrize("name", book.CHAPTERS)
def test_a_chapter_splits_into_pieces_that_join_back_to_it_exactly(name):
    text = (ROOT / name).read_text(encoding="utf-8")
    assert book.source_of(*book.chapter(text)) == text


@pytest.mark.parametrize("name", book.CHAPTERS)
def test_a_page_holds_every_line_the_main_text_open_and_every_appendix_folded(pages, name):
    source = (ROOT / name).read_text(encoding="utf-8")
    page = (pages / f"{name}.html").read_text(encoding="utf-8")
    seen, at = text_of(page), 0
    for line in source.split("\n"):  # every line in order: code as written, a comment as its words
        if not line.strip() or book.RULE.match(line):
            continue
        words = line.strip().lstrip("#").strip()
        # prose: its words, maybe joined with others
        if line.lstrip().startswith("#") and not line.startswith(" "):
            assert all(w in seen for w in words.split()), (name, line)
            continue
        found = seen.find(line.strip(), at)
        assert found >= 0, (name, line)
        at = found
    main, appendices = book.contents(source)
    assert main and appendices
    opened = page.index("<details>")
    for title in main:  # the main text: before the first fold, each section under its heading
        assert 0 <= page.index(f"<h2>{html.escape(title)}</h2>") < opened, title
    folds = re.findall(r"<details>(.*?)</details>", page, flags=re.S)
    assert len(folds) == len(appendices) and "<details open" not in page
    for title, fold in zip(appendices, folds):
        assert fold.startswith(f"<summary>{html.escape(title)}</summary>"), title


def test_the_index_gives_the_reading_order_and_each_chapters_contents(pages):
    index = (pages / "index.html").read_text(encoding="utf-8")
    assert [m for m in re.findall(r'href="(\w+\.py)\.html"', index)] == book.CHAPTERS
    for name in book.CHAPTERS:
        for title in sum(book.contents((ROOT / name).read_text(encoding="utf-8")), []):
            assert html.escape(title) in index, title
    assert "<script" not in index and all(
        "<script" not in p.read_text() for p in pages.glob("*.html")
    )


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
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (
            tmp_path / png
        ).stat().st_size > 20000
