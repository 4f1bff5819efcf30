"""The docs run as written: every ```python block of README.md and docs/*.md, and every relative link resolves."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from script_server import ScriptServer

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.MULTILINE)
TIMEOUT_S = 180


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def python_blocks() -> list[tuple[str, int, str]]:
    """``(page, line of the block's first code line, code)`` of every ```python block of the pages."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        blocks += [(_name(page), text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in BLOCK.finditer(text)]
    return blocks


def imported_modules(code: str) -> set[str]:
    """The top-level modules a block imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def missing_modules(code: str) -> list[str]:
    """Top-level modules the block imports that are not installed (optional extras such as torchrl)."""
    return sorted(name for name in imported_modules(code) if importlib.util.find_spec(name) is None)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a page: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    result = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        result.add(slug if n == 0 else f"{slug}-{n}")
    return result


def relative_links() -> list[tuple[str, str]]:
    """``(page, target)`` of every link of the pages outside code that is not a URL or a bare anchor of a URL."""
    links = []
    for page in PAGES:
        text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))
        links += [(_name(page), t) for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]
    return links


BLOCKS = python_blocks()
LINKS = relative_links()


def test_the_pages_have_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.fixture(scope="module")
def python():
    """Runs a script as ``python -W error SCRIPT`` would: in a fork of a warm interpreter (torch imported once), or
    a fresh interpreter where there is no fork."""
    if not hasattr(os, "fork"):
        yield lambda script, *, cwd, timeout: subprocess.run(
            [sys.executable, "-W", "error", str(script)], capture_output=True, text=True, timeout=timeout, cwd=cwd
        )
        return
    server = ScriptServer()
    try:
        yield server.run
    finally:
        server.close()


def block_id(page: str, line: int, code: str) -> str:
    """``page:line``; ``-ray`` after it for a block that starts Ray, which runs with the other Ray tests (conftest)."""
    return f"{page}:{line}" + ("-ray" if "ray" in imported_modules(code) else "")


@pytest.mark.parametrize(("page", "line", "code"), BLOCKS, ids=[block_id(*block) for block in BLOCKS])
def test_python_block_runs(page, line, code, tmp_path, python):
    where = f"{page} line {line}, the block starting {code.splitlines()[0]!r}"
    missing = missing_modules(code)
    if missing:
        pytest.skip(f"{where} imports {', '.join(missing)}, not installed")
    # A file, not -c: worker processes import the script again, as they would the reader's.
    script = tmp_path / f"{Path(page).stem}_line{line}.py"
    script.write_text(code)
    try:
        result = python(script, cwd=tmp_path, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{where} did not finish within {TIMEOUT_S} s")
    assert result.returncode == 0, f"{where} failed (exit code {result.returncode}):\n{result.stderr[-3000:]}"


def test_the_pages_have_relative_links():
    assert LINKS


@pytest.mark.parametrize(("page", "target"), LINKS, ids=[f"{page}->{target}" for page, target in LINKS])
def test_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    source = ROOT / page
    file = (source.parent / path).resolve() if path else source
    assert file.exists(), f"{page} links to {target}, but {file.relative_to(ROOT)} does not exist"
    if anchor:
        assert file.suffix == ".md", f"{page} links to {target}: an anchor into a file that is not markdown"
        assert anchor in anchors(file), f"{page} links to {target}, but {_name(file)} has no heading #{anchor}"


# The modules whose every test proves a row of the Reliability table (docs/reliability.md).
RELIABILITY_MODULES = [
    "test_background_faults.py",
    "test_consumer_interrupts.py",
    "test_exactly_once.py",
    "test_hostile_inputs.py",
    "test_resource_leaks.py",
]


def reliability_tests() -> set[str]:
    names = set()
    for module in RELIABILITY_MODULES:
        tree = ast.parse((ROOT / "tests" / module).read_text())
        functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
        names |= {node.name for node in functions if node.name.startswith("test_")}
    return names


def reliability_table() -> set[str]:
    """Test names in backticks in the Reliability table of docs/reliability.md."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    section = text.split("## Reliability", 1)[1].split("\n## ", 1)[0] if "## Reliability" in text else ""
    return set(re.findall(r"`(test_\w+)`", section))


def test_reliability_table_matches_the_tests():
    documented, existing = reliability_table(), reliability_tests()
    assert documented, "no Reliability table found in docs/reliability.md"
    assert documented - existing == set(), "the table names tests that do not exist"
    assert existing - documented == set(), "tests missing from the table"


def test_the_performance_pages_are_the_ones_single_scripts_md_renders():
    """``benchmarks/run.py`` writes the performance pages from ``benchmarks/single_scripts.md``: a page edited in
    docs/ alone would lose the edit at the next run."""
    check = (
        "import pathlib, run\n"
        "full = (run.DOCS / 'performance-full-run.md').read_text()\n"
        "for name, text in run.single_script_pages(full).items():\n"
        "    if (run.DOCS / name).read_text() != text:\n"
        "        print(name)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], (
        "edit these pages in benchmarks/single_scripts.md, then run benchmarks/run.py --pages"
    )
