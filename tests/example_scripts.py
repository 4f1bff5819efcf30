"""The example scripts of examples/, imported as modules by the tests (they are scripts, not part of the package)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CONFIGS = ROOT / "configs"


def import_script(name: str) -> Iterator[ModuleType]:
    """examples/NAME.py imported as a module, by the name that worker processes import it by (the script puts
    examples/ on sys.path, which they start with); yields it once and then lets go of the name.

    For a fixture: ``yield from import_script("ppo")``; in a test: ``(module,) = import_script("ppo")``.
    """
    if name in sys.modules:  # imported by a fixture of the test already
        yield sys.modules[name]
        return
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolves annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]
