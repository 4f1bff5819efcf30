"""The Reliability table names tests that exist, and every reliability test is in the table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def reliability_tests() -> set[str]:
    names = set()
    for path in sorted(ROOT.glob("tests/test_reliability_*.py")):
        if path.name == Path(__file__).name:
            continue
        tree = ast.parse(path.read_text())
        functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
        names |= {node.name for node in functions if node.name.startswith("test_")}
    return names


def table_names() -> set[str]:
    """Test names in backticks in the README's Reliability table."""
    names = set()
    for path in (ROOT / "docs" / "reliability.md", ROOT / "README.md"):
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
