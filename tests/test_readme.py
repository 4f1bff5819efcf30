"""README.md says what is true: every ```python block runs as written (each as a script of its own in a fresh
interpreter), and the Reliability table names the reliability tests, all of them."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The modules whose every test proves a row of the Reliability table (README.md, or docs/reliability.md).
RELIABILITY_MODULES = [
    "test_background_faults.py",
    "test_consumer_interrupts.py",
    "test_exactly_once.py",
    "test_hostile_inputs.py",
    "test_resource_leaks.py",
]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks() -> list[tuple[int, str]]:
    """``(line of the block's first code line, code)`` of every ```python block of the README."""
    text = README.read_text()
    return [(text.count("\n", 0, match.start(1)) + 1, match.group(1)) for match in BLOCK.finditer(text)]


def missing_modules(code: str) -> list[str]:
    """Top-level modules the block imports that are not installed (optional extras such as torchrl)."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return sorted(name for name in names if importlib.util.find_spec(name) is None)


BLOCKS = python_blocks()


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs(line, code, tmp_path):
    where = f"README.md line {line}, the block starting {code.splitlines()[0]!r}"
    missing = missing_modules(code)
    if missing:
        pytest.skip(f"{where} imports {', '.join(missing)}, not installed")
    # A file, not -c: worker processes import the script again, as they would the reader's.
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(code)
    try:
        result = subprocess.run(
            [sys.executable, "-W", "error", str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{where} did not finish within 180 s")
    assert result.returncode == 0, f"{where} failed (exit code {result.returncode}):\n{result.stderr[-3000:]}"


def reliability_tests() -> set[str]:
    names = set()
    for module in RELIABILITY_MODULES:
        tree = ast.parse((ROOT / "tests" / module).read_text())
        functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
        names |= {node.name for node in functions if node.name.startswith("test_")}
    return names


def table_names() -> set[str]:
    """Test names in backticks in the README's Reliability table."""
    names = set()
    for path in (ROOT / "docs" / "reliability.md", README):
        if path.exists():
            text = path.read_text()
            if "## Reliability" in text:
                section = text.split("## Reliability", 1)[1].split("\n## ", 1)[0]
                names |= set(re.findall(r"`(test_\w+)`", section))
    return names


def test_reliability_table_matches_the_tests():
    documented, existing = table_names(), reliability_tests()
    assert documented, "no Reliability table found in README.md"
    assert documented - existing == set(), "the table names tests that do not exist"
    assert existing - documented == set(), "tests missing from the table"
