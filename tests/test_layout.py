"""The layout of the book and its machinery, as the budgets of the project's design card.

The five chapters (norms.py <- model.py <- data.py <- decode.py <- train.py) hold the papers; the
package machinery/ holds flags, presets, run folders, checkpoints, logs, corpora and the command
lines, one module per job. Imports run one way, at the top of each file, with no cycle, across the
package too. Budgets count the lines `ruff format` lays out at 100 columns, so packing lines gains
nothing: they are met by a simpler design.
"""

import ast
import io
import re
import shutil
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["norms", "model", "data", "decode", "train"]  # the reading order of the chapters
CHAPTERS = {name: ROOT / f"{name}.py" for name in ORDER}
PACKAGE = {f"machinery.{p.stem}": p for p in sorted((ROOT / "machinery").glob("*.py"))}
MODULES = {**CHAPTERS, **PACKAGE}
CHAPTER_LINES, MAIN_TEXT_LINES, MODULE_LINES, FUNCTION_LINES, README_LINES = (
    4000,
    2800,
    800,
    80,
    250,
)
NOQA_MAX = 10


def project_imports(path):
    """[(module, lineno, at_top)]: the project modules (chapters and machinery) a file imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "machinery":
            mods = [f"machinery.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [node.module or ""]
        else:
            continue
        found += [(m, node.lineno, id(node) in top) for m in mods if m in MODULES]
    return found


def test_project_imports_are_at_the_top_of_each_file():
    inner = [
        f"{path.relative_to(ROOT)}:{line} imports {m}"
        for path in MODULES.values()
        for m, line, top in project_imports(path)
        if not top
    ]
    assert not inner, "project imports inside functions or blocks: " + "; ".join(inner)


def test_chapters_import_only_the_chapters_before_them():
    for i, name in enumerate(ORDER):
        for m, line, _ in project_imports(CHAPTERS[name]):
            assert m not in ORDER or ORDER.index(m) < i, (
                f"{name}.py:{line} imports {m}, which comes after it in the reading order"
            )


def test_imports_run_one_way_so_there_is_no_cycle():
    graph = {m: {d for d, _, _ in project_imports(p) if d != m} for m, p in MODULES.items()}
    done, path = set(), []

    def visit(m):
        if m in path:
            pytest.fail("an import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
        if m in done:
            return
        path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        path.pop()
        done.add(m)

    for m in graph:
        visit(m)


def main_text(path):
    """The lines above the chapter's first `# Appendix` line: what a first reading goes through."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return lines[: next((i for i, line in enumerate(lines) if line.startswith("# Appendix")), None)]


def lines_of(path):
    return len(path.read_text(encoding="utf-8").splitlines())


def test_the_chapters_stay_a_book_and_the_package_modules_stay_small():
    """The five chapters at most 4,000 formatted lines, their main text at most 2,800; each module
    of machinery/ at most 800."""
    sizes = {name: lines_of(path) for name, path in CHAPTERS.items()}
    assert sum(sizes.values()) <= CHAPTER_LINES, f"the chapters: {sum(sizes.values())}: {sizes}"
    main = {name: len(main_text(path)) for name, path in CHAPTERS.items()}
    assert sum(main.values()) <= MAIN_TEXT_LINES, f"their main text: {sum(main.values())}: {main}"
    big = {m: n for m, p in PACKAGE.items() if (n := lines_of(p)) > MODULE_LINES}
    assert not big, f"machinery modules over {MODULE_LINES} lines: {big}"


def python_files():
    """The project's own Python files that the layout rules hold for: chapters, package, book."""
    return [*MODULES.values(), ROOT / "docs" / "book.py"]


def test_no_function_is_longer_than_a_screen_or_two():
    """No function over 80 lines, but the argparse builders (a table of flags, one per entry)."""
    long = []
    for path in python_files():
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            size = getattr(n, "end_lineno", 0) - getattr(n, "lineno", 0) + 1
            if (
                isinstance(n, ast.FunctionDef)
                and size > FUNCTION_LINES
                and n.name != "build_parser"
            ):
                long.append(f"{path.relative_to(ROOT)}: {n.name} ({size} lines)")
    assert not long, "functions over 80 lines: " + ", ".join(long)


def one_line_forms(path):
    """The forms a student stops at: a conditional expression used as a statement, a lambda that
    does something (a call joined by `or`/`and`, or one assigned to a name or attribute), a call of
    more than six positional arguments."""
    found = []
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        where = f"{path.relative_to(ROOT)}:{getattr(n, 'lineno', 0)}"
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.IfExp):
            found.append(f"{where}: a conditional expression used as a statement")
        elif isinstance(n, ast.Lambda) and isinstance(n.body, ast.BoolOp):
            if any(isinstance(x, ast.Call) for x in ast.walk(n.body)):
                found.append(f"{where}: a lambda with a side effect")
        elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Lambda):
            found.append(f"{where}: a lambda assigned to a name")
        elif isinstance(n, ast.Call):
            positional = [a for a in n.args if not isinstance(a, ast.Starred)]
            if len(positional) > 6:
                found.append(f"{where}: a call of {len(positional)} positional arguments")
    return found


def test_a_line_does_one_thing():
    found = [f for path in python_files() for f in one_line_forms(path)]
    assert not found, "\n".join(found)


def test_few_noqa_each_with_its_reason():
    """At most 10 `# noqa` in the repository's Python files, each with its reason on its line."""
    noqa = [
        (path.relative_to(ROOT), token.start[0], token.string)
        for path in sorted(ROOT.rglob("*.py"))
        if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
        for token in tokenize.generate_tokens(io.StringIO(path.read_text("utf-8")).readline)
        if token.type == tokenize.COMMENT and re.match(r"#\s*noqa\b", token.string)
    ]
    assert len(noqa) <= NOQA_MAX, f"{len(noqa)} noqa: " + ", ".join(f"{p}:{n}" for p, n, _ in noqa)
    bare = [f"{p}:{n}" for p, n, line in noqa if not re.search(r"noqa(:\s*[A-Z]+\d+)*\W+\w", line)]
    assert not bare, "a noqa without its reason: " + ", ".join(bare)


def test_nothing_points_at_files_a_user_of_the_repository_does_not_have():
    for path in python_files():
        src = path.read_text(encoding="utf-8")
        assert "../shared" not in src and "REFERENCE.md" not in src, path.relative_to(ROOT)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="needs ruff (pip install ruff)")
def test_ruff_lays_out_and_checks_every_python_file():
    for command in (["ruff", "format", "--check", "."], ["ruff", "check", "."]):
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, " ".join(command) + ":\n" + done.stdout + done.stderr


def test_the_readme_is_a_landing_page_and_every_link_in_the_docs_resolves():
    """README.md is a landing page of at most 250 lines that links every page of docs/; in
    README.md and docs/*.md every relative link (text or image) points at a file of the
    repository, no prose line is over 120 characters (README.md's tables too; commands and program
    output in fenced blocks stay verbatim), no count that drifts (of tests, of exercises) is
    written down, and nothing points at files a user of the repository does not have."""
    readme, docs = ROOT / "README.md", sorted((ROOT / "docs").glob("*.md"))
    lines = readme.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines (the rest goes to docs/)"
    problems = []
    for page in [readme] + docs:
        text, name = page.read_text(encoding="utf-8"), page.relative_to(ROOT).as_posix()
        # fenced blocks: verbatim, not links
        prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            path = target.split("#")[0]
            resolved = (page.parent / path).resolve()
            if path and not re.match(r"[a-z]+:", path) and not resolved.is_file():
                problems.append(f"{name} links {target}, which does not exist")
        for line in prose.splitlines():
            if len(line) > 120 and (page == readme or not line.startswith("|")):
                problems.append(f"{name}: a line over 120 characters: {line[:50]}...")
        problems += [
            f"{name} writes down a count that drifts: {m}"
            for m in re.findall(r"\b\d[\d,]* (?:tests|exercises|passed)\b", text)
        ]
        if "../shared" in text or "REFERENCE.md" in text:
            problems.append(f"{name} points at ../shared or REFERENCE.md, which users do not have")
    targets = re.findall(r"\]\(([^)\s]+)\)", readme.read_text("utf-8"))
    linked = {(ROOT / t.split("#")[0]).resolve() for t in targets}
    problems += [
        f"README.md does not link {p.relative_to(ROOT).as_posix()}"
        for p in docs
        if p.resolve() not in linked
    ]
    assert not problems, "\n".join(problems)
