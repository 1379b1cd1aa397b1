"""The five chapters as a book: ``python docs/book.py`` writes docs/book/index.html, one page per
chapter and one page for the machinery beside them.

Each page reads as the Annotated Transformer does: a file's comments become prose beside the code
they precede, each section (the blocks between ``# ---`` rules) under its heading, the main text
first and each appendix folded under its heading (HTML's own <details>: no JavaScript). The pages
work offline: one self-contained file each, the code highlighted by Pygments (which rich installs).
Nothing of a file is dropped: chapter() splits it into pieces that join back to it exactly
(tests/test_book.py checks that, and that the pages hold every line).

In prose, ``x`` is code, and a paper's citation [N] links to its entry: the chapter's own reference
list (its docstring's "[N] Author Year, Title." lines, one numbering for the whole project) when it
lists N, else the index's list of every paper the chapters cite. The machinery's page lists the
modules of machinery/ with their docstrings: a reader of the book never needs to open them.
"""

import argparse
import ast
import html
import re
import sys
from pathlib import Path

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

ROOT = Path(__file__).resolve().parent.parent
# The reading order: imports run one way.
CHAPTERS = ["norms.py", "model.py", "data.py", "decode.py", "train.py"]
# The package of the machinery, and its page in the book.
PACKAGE, PACKAGE_PAGE = "machinery", "machinery.html"
# A section's rule: --- for the main text's, === for an appendix's.
RULE = re.compile(r"^# (-{20,}|={20,})$")
# The papers' table rows as presets (the index links to them).
PAPERS = "../papers.md"
# ``x`` in prose: code.
CODE = re.compile(r"``(.+?)``", flags=re.S)
# A reference list's entry, "[N] Author Year, Title.", found in escaped text (& is &amp;).
ENTRY = re.compile(r"\[(\d+)\](?= [A-Z][^\[\]\n]{0,40}? (?:19|20)\d\d,)")
# A citation: [N], [N, eq. 5], [N; Code: ...], [N appendix A], [N, M]; not an index such as x[1]
# (a word, a bracket or a tag just before it).
CITE = re.compile(r"(?<![\w\]>)])\[(\d+(?:, \d+)*)(?=[\],;\s])")


def chapter(text):
    """(intro, sections) of a chapter's source. intro: its docstring's lines; a section: dict(title,
    head: its heading's lines from rule to rule, blocks, appendix: whether it is folded); a block:
    (comment lines before the code, code lines). Every line is in exactly one piece, in order:
    source_of() joins them back."""
    lines = text.split("\n")
    # The module docstring.
    end = next(i for i in range(1, len(lines)) if lines[i].rstrip().endswith('"""')) + 1
    intro, sections = lines[:end], [dict(title="", head=[], blocks=[([], [])], appendix=False)]
    i = end
    while i < len(lines):
        line = lines[i]
        if RULE.match(line):  # A section's heading: the comment lines up to the next rule.
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
        # A column-0 comment is prose for the code after it.
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


def references(intro):
    """{N: entry} of a chapter's reference list: each "[N] Author Year, Title." in its docstring,
    the entry running to the next one, a blank line, a line that is not indented or the end."""
    text = "\n".join(intro)
    marks = list(ENTRY.finditer(text))
    ends = [m.start() for m in marks[1:]] + [len(text)]
    out = {}
    for m, end in zip(marks, ends, strict=True):
        entry = re.split(r'\n\s*\n|\n\S|"""', text[m.end() : end])[0]
        out[int(m.group(1))] = " ".join(entry.split())
    return out


def inline(text, refs=None):
    """Text as HTML: escaped, ``x`` as code, and each citation [N] linked to refs[N] (where to find
    N's entry) when refs has N."""
    return link_citations(CODE.sub(r"<code>\1</code>", html.escape(text, quote=False)), refs)


def link_citations(escaped, refs):
    """HTML with each citation's numbers that refs has linked: [1, eq. 5] -> [<a>1</a>, eq. 5]."""
    if not refs:
        return escaped

    def one(number):
        n = number.group()
        return f'<a href="{refs[int(n)]}">{n}</a>' if int(n) in refs else n

    return CITE.sub(lambda m: "[" + re.sub(r"\d+", one, m.group(1)), escaped)


def text_html(lines, refs):
    """Lines of prose as HTML: plain lines joined into paragraphs, indented ones (equations, tables)
    kept as they are."""
    out, para = [], []
    for line in lines:
        if line.startswith("  ") or not line.strip():  # An equation or a table line: as written.
            if para:
                out.append(f"<p>{inline(' '.join(para), refs)}</p>")
                para = []
            if line.strip():
                out.append(f'<pre class="eq">{inline(line, refs)}</pre>')
        else:
            para.append(line)
    if para:
        out.append(f"<p>{inline(' '.join(para), refs)}</p>")
    return "\n".join(out)


def prose_html(comment_lines, refs):
    """Comment lines as prose (text_html of their text)."""
    return text_html([c[2:] if c.startswith("# ") else c[1:] for c in comment_lines], refs)


def intro_html(intro, refs):
    """A chapter's docstring as written, each entry of its reference list with its anchor
    (id="ref-N", where the citations link)."""
    marked = ENTRY.sub(r'<span id="ref-\1">[\1]</span>', inline("\n".join(intro)))
    return f'<pre class="intro">{link_citations(marked, refs)}</pre>'


def code_html(lines):
    text = "\n".join(lines).strip("\n")
    if not text:
        return ""
    return highlight(text, PythonLexer(stripnl=False, ensurenl=False), HtmlFormatter(nowrap=False))


def row(prose, code=""):
    return f'<div class="row"><div class="prose">{prose}</div><div class="code">{code}</div></div>'


def section_html(s, anchor, refs):
    """A section: its heading and its prose, then each block, prose beside code."""
    head = [h for h in s["head"] if not RULE.match(h)][1:]  # The heading's prose, below its title.
    blocks = list(s["blocks"])
    # The heading's prose goes beside the section's first code, when that code has no comment.
    if blocks and not blocks[0][0]:
        blocks[0], head = (head, blocks[0][1]), []
    parts = [f'<section id="{anchor}">']
    if s["title"]:
        parts.append(f"<h2>{inline(s['title'], refs)}</h2>")
    if head:
        parts.append(row(prose_html(head, refs)))
    for prose, code in blocks:
        if prose or any(c.strip() for c in code):
            parts.append(row(prose_html(prose, refs), code_html(code)))
    return "\n".join(parts + ["</section>"])


STYLE = """
body { font-family: Georgia, serif; margin: 0 auto; max-width: 1500px; padding: 1em 2em;
  color: #222; }
nav { font-family: sans-serif; font-size: 0.9em; margin-bottom: 1em; } nav a { margin-right: 1em; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; border-top: 1px solid #ccc; padding-top: 0.6em; }
.row { display: flex; gap: 1.5em; align-items: flex-start; }
.prose { flex: 0 0 36%; font-size: 0.95em; line-height: 1.45; } .prose p { margin: 0.3em 0 0.6em; }
.code { flex: 1; min-width: 0; overflow-x: auto; font-size: 0.8em; }
pre { margin: 0.2em 0; }
pre.eq { white-space: pre-wrap; font-size: 0.85em; background: #f6f6f0; padding: 0 0.3em; }
pre.intro { white-space: pre-wrap; background: #f6f6f0; padding: 0.8em; font-size: 0.85em; }
code { background: #f3f3ee; padding: 0 0.15em; }
details { border: 1px solid #ddd; margin: 1em 0; padding: 0.3em 0.8em; }
summary { cursor: pointer; font-weight: bold; font-family: sans-serif; }
"""


def page(title, body, nav):
    css = STYLE + HtmlFormatter().get_style_defs(".highlight")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{css}</style></head>\n"
        f"<body>\n<nav>{nav}</nav>\n{body}\n</body></html>\n"
    )


def chapter_page(name, text, nav, everyone):
    """One chapter's page: the docstring, the main text's sections, then each appendix folded
    (closed). everyone: {N: entry} of every paper cited; a citation links to the chapter's own
    list when it has N, else to the index's."""
    intro, sections = chapter(text)
    refs = {n: f"index.html#ref-{n}" for n in everyone}
    refs.update({n: f"#ref-{n}" for n in references(intro)})
    body = [f"<h1>{html.escape(name)}</h1>", intro_html(intro, refs)]
    folded = None
    for n, s in enumerate(sections):
        if s["appendix"] and s["title"].startswith("Appendix"):
            body.append("</details>" if folded else "")
            folded = s["title"]
            body.append(f"<details><summary>{inline(s['title'], refs)}</summary>")
        body.append(section_html(s, f"s{n}", refs))
    body.append("</details>" if folded else "")
    return page(name, "\n".join(body), nav)


def contents(text):
    """(main-text section titles, appendix titles) of a chapter: the index's table of contents."""
    _, sections = chapter(text)
    return (
        [s["title"] for s in sections if s["title"] and not s["appendix"]],
        [s["title"] for s in sections if s["title"].startswith("Appendix")],
    )


def modules():
    """[(path from the root, its docstring)] of the package's modules, in name order (not
    __init__.py; read, not imported)."""
    out = []
    for path in sorted((ROOT / PACKAGE).glob("*.py")):
        if path.name != "__init__.py":
            tree = ast.parse(path.read_text(encoding="utf-8"))
            out.append((f"{PACKAGE}/{path.name}", ast.get_docstring(tree) or ""))
    return out


def package_page(nav, everyone):
    """The machinery's page: each module of the package with its docstring."""
    refs = {n: f"index.html#ref-{n}" for n in everyone}
    body = [
        f"<h1>The machinery: the modules of {PACKAGE}/</h1>",
        "<p>The flags, presets, run directory, log, speed, processes, corpora and plots the "
        "chapters use. A reader of the book never needs to open them; each says here what it "
        "holds and who calls it.</p>",
    ]
    for name, doc in modules():
        anchor = name.replace("/", "-").removesuffix(".py")
        body.append(f'<section id="{anchor}">\n<h2>{html.escape(name)}</h2>')
        body.append(text_html(doc.split("\n"), refs) + "\n</section>")
    return page(f"The machinery: {PACKAGE}/", "\n".join(body), nav)


def index_page(texts, everyone):
    """The index: the reading order and each chapter's contents, the machinery's page, and every
    paper the chapters cite (the citations' targets, id="ref-N")."""
    refs = {n: f"#ref-{n}" for n in everyone}
    items = []
    for k, c in enumerate(CHAPTERS):
        main, appendices = contents(texts[c])
        lines = "".join(f"<li>{inline(t, refs)}</li>" for t in main)
        folded = "".join(f"<li>{inline(t, refs)}</li>" for t in appendices)
        items.append(
            f'<li><a href="{c}.html"><b>Chapter {k + 1}: {c}</b></a><ul>{lines}</ul>'
            f"<p>Appendices (folded on the page):</p><ul>{folded}</ul></li>"
        )
    papers = "".join(
        f'<li id="ref-{n}">[{n}] {inline(e)}</li>' for n, e in sorted(everyone.items())
    )
    return (
        "<h1>Normalization for Transformer translation, annotated</h1>\n"
        "<p>Read the chapters in this order: each file imports only the ones before it. On each "
        "page the comments are the prose beside the code they explain; the appendices (fast "
        "paths, the released code's variants, diagnostics) are folded under their headings. "
        f"The papers {inline('[1]-[3]', refs)} and the others cited are listed "
        '<a href="#papers">below</a>; the rows of their tables, as presets, are on '
        f'<a href="{PAPERS}">the papers\' page</a>.</p>\n'
        f"<ul>{''.join(items)}</ul>\n"
        f"<p>The machinery beside the chapters (flags, run directory, log, corpora, plots): "
        f'<a href="{PACKAGE_PAGE}">the modules of {PACKAGE}/</a>, each with its docstring.</p>\n'
        f'<h2 id="papers">The papers (one numbering for the whole book)</h2>\n<ul>{papers}</ul>'
    )


def build(out):
    """Writes the index, the five chapters' pages and the machinery's page into `out`; returns the
    paths written."""
    out.mkdir(parents=True, exist_ok=True)
    texts = {c: (ROOT / c).read_text(encoding="utf-8") for c in CHAPTERS}
    everyone = {}  # Each paper's entry as the first chapter to list it gives it.
    for c in CHAPTERS:
        for n, entry in references(chapter(texts[c])[0]).items():
            everyone.setdefault(n, entry)
    home = '<a href="index.html">contents</a>'
    written = []
    for k, c in enumerate(CHAPTERS):
        nav = home + "".join(
            f'<a href="{CHAPTERS[j]}.html">{label} {CHAPTERS[j]}</a>'
            for j, label in ((k - 1, "previous:"), (k + 1, "next:"))
            if 0 <= j < len(CHAPTERS)
        )
        (out / f"{c}.html").write_text(chapter_page(c, texts[c], nav, everyone), encoding="utf-8")
        written.append(out / f"{c}.html")
    (out / PACKAGE_PAGE).write_text(package_page(home, everyone), encoding="utf-8")
    body = index_page(texts, everyone)
    (out / "index.html").write_text(page("The book: contents", body, home), encoding="utf-8")
    return [out / "index.html"] + written + [out / PACKAGE_PAGE]


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
