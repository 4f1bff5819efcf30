"""The package's shape: layers as subpackages that import only downwards, and rooms small enough to read.

Limits (code lines: neither blank, nor comments, nor docstrings): a class at most 300, a function's body at
most 50, a module at most 600 lines in all. Run this file alone to see every size against its limit.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "torch_rollout"
# The public face: the only modules at the package's root
FACE = {"__init__.py", "__main__.py", "collector.py", "gae.py", "replay.py", "tuning.py"}
# Each layer and the layers it may import (its own modules always), from the top down
LAYERS = {
    "placements": {"loop", "envs", "util", "gae"},
    "loop": {"envs", "util"},
    "envs": {"util"},
    "util": set(),
}
CLASS_LIMIT, BODY_LIMIT, MODULE_LIMIT = 300, 50, 600


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def code_lines(source: str) -> set[int]:
    """The line numbers of ``source`` that hold code: no blank line, comment or docstring."""
    tree = ast.parse(source)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        if token.type == tokenize.ENDMARKER:
            continue
        lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


def sizes() -> list[tuple[str, str, int, int]]:
    """``(module, what, code lines, limit)`` of every class, function body and module of the package."""
    found = []
    for path in modules():
        source = path.read_text()
        code = code_lines(source)
        found.append((_name(path), "module", source.count("\n"), MODULE_LIMIT))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                found.append((_name(path), f"class {node.name}", len(code.intersection(span)), CLASS_LIMIT))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = range(node.body[0].lineno, (node.end_lineno or node.lineno) + 1)
                found.append((_name(path), f"def {node.name}", len(code.intersection(span)), BODY_LIMIT))
    return found


def test_code_lines_leave_out_docstrings_comments_and_blanks():
    source = 'def f(x):\n    """Doc\n    string."""\n    # why\n\n    return (x +\n            1)\n'
    assert code_lines(source) == {1, 6, 7}


def test_no_class_body_or_module_over_its_limit():
    over = [f"{module}: {what} has {n} lines, limit {limit}" for module, what, n, limit in sizes() if n > limit]
    assert not over, "\n".join(over)


def test_the_package_root_holds_only_the_public_face():
    root = {path.name for path in PACKAGE.glob("*.py")}
    assert root <= FACE, sorted(root - FACE)
    assert {path.name for path in PACKAGE.iterdir() if path.is_dir() and path.name != "__pycache__"} == set(LAYERS)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch_rollout"):
            parts = node.module.split(".")
            if len(parts) == 1:  # from torch_rollout import envs
                found.update(alias.name for alias in node.names)
            else:
                found.add(parts[1])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("torch_rollout."))
    return found


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_a_layer_imports_only_the_layers_below_it(layer):
    allowed = LAYERS[layer] | {layer}
    wrong = {
        _name(path): sorted(_imports(path) - allowed)
        for path in sorted((PACKAGE / layer).glob("*.py"))
        if _imports(path) - allowed
    }
    assert not wrong, wrong


if __name__ == "__main__":
    for module, what, n, limit in sorted(sizes(), key=lambda row: row[2] / row[3], reverse=True)[:40]:
        print(f"{n:5d} / {limit:3d}  {module}: {what}")
