"""The five chapters as a book: ``python docs/book.py`` writes docs/book/index.html and one page per
chapter.

Each page reads as the Annotated Transformer does: a file's comments become prose beside the code
they precede, each section (the blocks between ``# ---`` rules) under its heading, the main text
first and each appendix folded under its heading (HTML's own <details>: no JavaScript). The pages
work offline: one self-contained file each, the code highlighted by Pygments (which rich installs).
Nothing of a file is dropped: chapter() splits it into pieces that join back to it exactly
(tests/test_book.py checks that, and that the pages hold every line).
"""

import argparse
import html
import re
import sys
from pathlib import Path

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

ROOT = Path(__file__).resolve().parent.parent
# the reading order: imports run one way
CHAPTERS = ["norms.py", "model.py", "data.py", "decode.py", "train.py"]
# a section's rule: --- for the main text's, === for an appendix's
RULE = re.compile(r"^# (-{20,}|={20,})$")
# where [1], [2], [3] ... point (docs/papers.md: each paper's rows and numbers)
PAPERS = "../papers.md"


def chapter(text):
    """(intro, sections) of a chapter's source. intro: its docstring's lines; a section: dict(title,
    head: its heading's lines from rule to rule, blocks, appendix: whether it is folded); a block:
    (comment lines before the code, code lines). Every line is in exactly one piece, in order:
    source_of() joins them back."""
    lines = text.split("\n")
    # the module docstring
    end = next(i for i in range(1, len(lines)) if lines[i].rstrip().endswith('"""')) + 1
    intro, sections = lines[:end], [dict(title="", head=[], blocks=[([], [])], appendix=False)]
    i = end
    while i < len(lines):
        line = lines[i]
        if RULE.match(line):  # a section's heading: the comment lines up to the next rule
            j = next(k for k in range(i + 1, len(lines)) if RULE.match(lines[k]))
            title = lines[i + 1][2:] if j > i + 1 else ""
            appendix = title.startswith("Appendix") or (
                sections[-1]["appendix"] and not title[:1].isdigit()
            )
            sections.append(
                dict(title=title, head=lines[i : j + 1], blocks=[([], [])], appendix=appendix)
            )
            i = j + 1
            continue
        prose, code = sections[-1]["blocks"][-1]
        # a column-0 comment: prose for the code after it
        if line.startswith("#") and not line.startswith("#!"):
            if code:
                sections[-1]["blocks"].append(([], []))
            sections[-1]["blocks"][-1][0].append(line)
        else:
            code.append(line)
        i += 1
    return intro, sections


def source_of(intro, sections):
    """The source chapter() split, joined back (the test of losslessness)."""
    out = list(intro)
    for s in sections:
        out += s["head"]
        for prose, code in s["blocks"]:
            out += prose + code
    return "\n".join(out)


def prose_html(comment_lines):
    """Comment lines as prose: plain lines joined into paragraphs, indented ones (equations, tables)
    kept as they are; a paper's reference [N] linked to the papers' page."""
    out, para = [], []
    for line in [c[2:] if c.startswith("# ") else c[1:] for c in comment_lines]:
        if line.startswith("  ") or not line.strip():  # an equation or a table line: as written
            if para:
                out.append(f"<p>{' '.join(para)}</p>")
                para = []
            if line.strip():
                out.append(f'<pre class="eq">{link(html.escape(line))}</pre>')
        else:
            para.append(link(html.escape(line)))
    if para:
        out.append(f"<p>{' '.join(para)}</p>")
    return "\n".join(out)


def link(escaped):
    return re.sub(r"\[(\d+)(?=[,\]\s])", rf'[<a href="{PAPERS}">\1</a>', escaped)


def code_html(lines):
    text = "\n".join(lines).strip("\n")
    if not text:
        return ""
    return highlight(text, PythonLexer(stripnl=False, ensurenl=False), HtmlFormatter(nowrap=False))


def section_html(s, anchor):
    """A section: its heading and its prose, then each block, prose beside code."""
    head = [h for h in s["head"] if not RULE.match(h)][1:]  # the heading's prose, below its title
    blocks = list(s["blocks"])
    # beside the section's first code, when that code has no comment of its own
    if blocks and not blocks[0][0]:
        blocks[0], head = (head, blocks[0][1]), []
    parts = [f'<section id="{anchor}">'] + (
        [f"<h2>{html.escape(s['title'])}</h2>"] if s["title"] else []
    )
    if head:
        parts.append(
            f'<div class="row"><div class="prose">{prose_html(head)}</div><div class="code"></div></div>'
        )
    for prose, code in blocks:
        if prose or any(c.strip() for c in code):
            parts.append(
                f'<div class="row"><div class="prose">{prose_html(prose)}</div>'
                f'<div class="code">{code_html(code)}</div></div>'
            )
    return "\n".join(parts + ["</section>"])


STYLE = """
body { font-family: Georgia, serif; margin: 0 auto; max-width: 1500px; padding: 1em 2em; color: #222; }
nav { font-family: sans-serif; font-size: 0.9em; margin-bottom: 1em; } nav a { margin-right: 1em; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; border-top: 1px solid #ccc; padding-top: 0.6em; }
.row { display: flex; gap: 1.5em; align-items: flex-start; }
.prose { flex: 0 0 36%; font-size: 0.95em; line-height: 1.45; } .prose p { margin: 0.3em 0 0.6em; }
.code { flex: 1; min-width: 0; overflow-x: auto; font-size: 0.8em; }
pre { margin: 0.2em 0; } pre.eq { white-space: pre-wrap; font-size: 0.85em; background: #f6f6f0; padding: 0 0.3em; }
pre.intro { white-space: pre-wrap; background: #f6f6f0; padding: 0.8em; font-size: 0.85em; }
details { border: 1px solid #ddd; margin: 1em 0; padding: 0.3em 0.8em; }
summary { cursor: pointer; font-weight: bold; font-family: sans-serif; }
"""


def page(title, body, nav):
    css = STYLE + HtmlFormatter().get_style_defs(".highlight")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{css}</style></head>\n<body>\n<nav>{nav}</nav>\n{body}\n</body></html>\n"
    )


def chapter_page(name, text, nav):
    """One chapter's page: the docstring, the main text's sections, then each appendix folded
    (closed)."""
    intro, sections = chapter(text)
    body = [
        f"<h1>{html.escape(name)}</h1>",
        f'<pre class="intro">{link(html.escape(chr(10).join(intro)))}</pre>',
    ]
    folded = None
    for n, s in enumerate(sections):
        if s["appendix"] and s["title"].startswith("Appendix"):
            body.append("</details>" if folded else "")
            folded = s["title"]
            body.append(f"<details><summary>{html.escape(s['title'])}</summary>")
        body.append(section_html(s, f"s{n}"))
    body.append("</details>" if folded else "")
    return page(name, "\n".join(body), nav)


def contents(text):
    """(main-text section titles, appendix titles) of a chapter: the index's table of contents."""
    _, sections = chapter(text)
    return (
        [s["title"] for s in sections if s["title"] and not s["appendix"]],
        [s["title"] for s in sections if s["title"].startswith("Appendix")],
    )


def build(out):
    """Writes the index and the five chapters' pages into `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    texts = {c: (ROOT / c).read_text(encoding="utf-8") for c in CHAPTERS}
    home = '<a href="index.html">contents</a>'
    written = []
    for k, c in enumerate(CHAPTERS):
        nav = home + "".join(
            f'<a href="{CHAPTERS[j]}.html">{label} {CHAPTERS[j]}</a>'
            for j, label in ((k - 1, "previous:"), (k + 1, "next:"))
            if 0 <= j < len(CHAPTERS)
        )
        (out / f"{c}.html").write_text(chapter_page(c, texts[c], nav), encoding="utf-8")
        written.append(out / f"{c}.html")
    items = []
    for k, c in enumerate(CHAPTERS):
        main, appendices = contents(texts[c])
        lines = "".join(f"<li>{html.escape(t)}</li>" for t in main)
        folded = "".join(f"<li>{html.escape(t)}</li>" for t in appendices)
        items.append(
            f'<li><a href="{c}.html"><b>Chapter {k + 1}: {c}</b></a><ul>{lines}</ul>'
            f"<p>Appendices (folded on the page):</p><ul>{folded}</ul></li>"
        )
    body = (
        "<h1>Normalization for Transformer translation, annotated</h1>\n<p>Read the chapters in this order: each "
        "file imports only the ones before it. On each page the comments are the prose beside the code they "
        "explain; the appendices (fast paths, plumbing, benchmarks) are folded under their headings. The papers "
        f'[1]-[3] and the others cited are listed on <a href="{PAPERS}">the papers\' page</a>.</p>\n'
        f"<ul>{''.join(items)}</ul>"
    )
    (out / "index.html").write_text(page("The book: contents", body, home), encoding="utf-8")
    return [out / "index.html"] + written


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", default=str(ROOT / "docs" / "book"), help="the folder to write (default docs/book)"
    )
    a = p.parse_args(argv)
    for path in build(Path(a.out)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
