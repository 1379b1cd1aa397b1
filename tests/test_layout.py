"""The five files read as one tutorial: imports run one way, all at the top of each file.

norms.py <- model.py <- data.py <- decode.py <- train.py: each file imports only files before it,
at its top, so every file can be read with what came before and there is no import cycle.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["norms", "model", "data", "decode", "train"]


def project_imports(name):
    """[(module, lineno, at_top)] of the project modules that file `name` imports."""
    tree = ast.parse((ROOT / f"{name}.py").read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [(node.module or "").split(".")[0]]
        else:
            continue
        found += [(m, node.lineno, id(node) in top) for m in mods if m in ORDER]
    return found


def test_project_imports_are_at_the_top_of_each_file():
    inner = [
        f"{name}.py:{line} imports {m}"
        for name in ORDER
        for m, line, top in project_imports(name)
        if not top
    ]
    assert not inner, "project imports inside functions: " + "; ".join(inner)


def test_imports_run_one_way_so_there_is_no_cycle():
    for i, name in enumerate(ORDER):
        for m, line, _ in project_imports(name):
            assert ORDER.index(m) < i, (
                f"{name}.py:{line} imports {m}, which comes after it in the reading order"
            )


def main_text(name):
    """The lines above the file's first `# Appendix` line: what a first reading goes through."""
    lines = (ROOT / f"{name}.py").read_text(encoding="utf-8").splitlines()
    return lines[: next(i for i, line in enumerate(lines) if line.startswith("# Appendix"))]


def test_the_main_text_stays_a_course_not_a_codebase():
    """The five main texts together stay under 2,000 lines (a course a student reads through),
    train.py under 1,700 lines, decode.py under 1,350 and the five files under 5,400; no function
    is over 60 lines but the flag parsers, no line over 120 characters; nothing points at files a
    user of the repository does not have."""
    sizes = {name: len(main_text(name)) for name in ORDER}
    assert sum(sizes.values()) <= 2000, f"main text {sum(sizes.values())} lines: {sizes}"
    # The whole files too (the developers' guide: machinery redesigned with one owner per rule, not
    # grown).
    files = {
        name: len((ROOT / f"{name}.py").read_text(encoding="utf-8").splitlines()) for name in ORDER
    }
    assert files["train"] <= 1700 and files["decode"] <= 1350, files
    assert sum(files.values()) <= 5400, f"the five files: {sum(files.values())} lines: {files}"
    for name in ORDER:
        src = (ROOT / f"{name}.py").read_text(encoding="utf-8")
        assert "../shared" not in src and "REFERENCE.md" not in src, name
        long = [
            f"{n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(src))
            if isinstance(n, ast.FunctionDef)
            and n.end_lineno - n.lineno >= 60
            and n.name != "build_parser"
        ]
        assert not long, f"{name}.py: " + ", ".join(long)
        wide = [i + 1 for i, line in enumerate(src.splitlines()) if len(line) > 120]
        assert not wide, f"{name}.py: lines over 120 characters: {wide}"


def test_the_readme_is_a_landing_page_and_every_link_in_the_docs_resolves():
    """README.md is a landing page of at most 250 lines that links every page of docs/; in README.md
    and docs/*.md every relative link (text or image) points at a file of the repository, no prose
    line is over 120 characters (README.md's tables too; commands and program output in fenced
    blocks stay verbatim), no count that drifts (of tests, of exercises) is written down, and
    nothing points at files a user of the repository does not have."""
    import re

    readme, docs = ROOT / "README.md", sorted((ROOT / "docs").glob("*.md"))
    lines = readme.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, (
        f"README.md has {len(lines)} lines (at most 250: the rest goes to docs/)"
    )
    problems = []
    for page in [readme] + docs:
        text, name = page.read_text(encoding="utf-8"), page.relative_to(ROOT).as_posix()
        # fenced blocks: verbatim, not links
        prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            path = target.split("#")[0]
            if (
                path
                and not re.match(r"[a-z]+:", path)
                and not (page.parent / path).resolve().is_file()
            ):
                problems.append(f"{name} links {target}, which does not exist")
        for i, line in enumerate(prose.splitlines()):
            if len(line) > 120 and (page == readme or not line.startswith("|")):
                problems.append(f"{name}: a line over 120 characters: {line[:50]}...")
        problems += [
            f"{name} writes down a count that drifts: {m}"
            for m in re.findall(r"\b\d[\d,]* (?:tests|exercises|passed)\b", text)
        ]
        if "../shared" in text or "REFERENCE.md" in text:
            problems.append(f"{name} points at ../shared or REFERENCE.md, which users do not have")
    linked = {
        (ROOT / t.split("#")[0]).resolve()
        for t in re.findall(r"\]\(([^)\s]+)\)", readme.read_text("utf-8"))
    }
    problems += [
        f"README.md does not link {p.relative_to(ROOT).as_posix()}"
        for p in docs
        if p.resolve() not in linked
    ]
    assert not problems, "\n".join(problems)
