"""Session-wide set-up: fewer combinations on Ray, its local Ray stopped at the end, SIGINT caught, the
tests shared among pytest-xdist's workers by file, with every Ray test in one worker, ``--without-ray`` and
``--only-ray``."""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import pytest

from placements import on_ray, stop_local_ray

# A shell that starts a job in the background without job control (`make test &`, `nohup ... &`) starts it
# with SIGINT ignored, and an ignored signal stays ignored across exec: the tests that press Ctrl-C on a child
# process would see it run on. Catch SIGINT again, as an interactive run does; children then start with it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# A Ray actor starts in a fresh interpreter that imports torch and tensordict (seconds of CPU each), where a
# worker process forks from a preloaded server. So a test parametrized over the placements runs on Ray only
# where Ray's own code is at stake (weights riding with requests, shares concatenated in order, errors and
# their env indices coming back from actors, AsyncVectorEnv inside an actor), and says so itself:
#
#     @pytest.mark.ray(prefetch=(3,), mode=(AutoresetMode.NEXT_STEP,))
#
# runs it on Ray for those values of those parameters only (any value of the others); a bare
# @pytest.mark.ray runs every combination there; without the marker it is skipped on Ray. The
# trainer-side logic the placements share stays on the local ones (the loop's finite checks, and a
# replaced parameter of a new shape, which the trainer refuses). A marker that names a parameter the
# test lacks, or a value none of its parameters takes, is a collection error: a typo cannot drop a test.
LEFT_TO_LOCAL = "left to the local placements on Ray (its actors take seconds to start)"


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> Any:
    collected = yield
    if isinstance(collected, list):  # a test function's items, one per combination of its parameters
        _keep_on_ray(collector, [item for item in collected if isinstance(item, pytest.Function)])
    return collected


def _keep_on_ray(collector: pytest.Collector, items: list[pytest.Function]) -> None:
    """Skips the items of one test function on the Ray placement, except those its ``ray`` marker keeps."""
    on_ray = [item for item in items if _on_ray(item)]
    marker = items[0].get_closest_marker("ray") if items else None
    if marker is None:
        for item in on_ray:
            item.add_marker(pytest.mark.skip(reason=f"{LEFT_TO_LOCAL}; @pytest.mark.ray runs a test there"))
        return
    kept = _check_marker(collector, items[0].originalname, marker, on_ray)
    for item in on_ray:
        params = item.callspec.params
        if not all(any(_same(value, params[name]) for value in values) for name, values in kept.items()):
            item.add_marker(pytest.mark.skip(reason=f"{LEFT_TO_LOCAL}; its @pytest.mark.ray keeps {kept}"))


def _check_marker(
    collector: pytest.Collector, test: str, marker: pytest.Mark, on_ray: list[pytest.Function]
) -> dict[str, tuple[Any, ...]]:
    """The marker's ``{parameter: values}``, or a collection error that says what in it the test does not have."""
    where = f"{test}: @pytest.mark.ray"
    if marker.args:
        raise collector.CollectError(
            f"{where} takes keyword arguments only, parameter=(values, ...), got positional {marker.args!r}"
        )
    if not on_ray:
        raise collector.CollectError(
            f"{where} is given, but the test never runs on the Ray placement: parametrize it over "
            "placements.PLACEMENTS, or remove the marker"
        )
    names = sorted({name for item in on_ray for name in item.callspec.params if name != "placement"})
    for name, values in marker.kwargs.items():
        if not isinstance(values, tuple | list) or not values:
            raise collector.CollectError(
                f"{where}({name}={values!r}): give the values to keep as a non-empty tuple, e.g. {name}=({values!r},)"
            )
        if name not in names:
            raise collector.CollectError(
                f"{where}({name}=...) names a parameter the test does not have on Ray; it has {names}"
            )
        taken = _unique(item.callspec.params[name] for item in on_ray)
        for value in values:
            if not any(_same(value, param) for param in taken):
                raise collector.CollectError(
                    f"{where}({name}={tuple(values)!r}): {value!r} is not a value of {name!r}, which takes {taken!r}"
                )
    return {name: tuple(values) for name, values in marker.kwargs.items()}


def _on_ray(item: pytest.Function) -> bool:
    """Whether the item's ``placement`` parameter (Collector keyword arguments) puts the collection on Ray."""
    callspec = getattr(item, "callspec", None)
    placement = callspec.params.get("placement") if callspec is not None else None
    return isinstance(placement, dict) and on_ray(placement)


def _same(value: Any, param: Any) -> bool:
    """A marker's value names a parameter's value: equal and of the same type (3 is not 3.0 or True)."""
    return value is param or (type(value) is type(param) and bool(value == param))


def _unique(params: Any) -> list[Any]:
    unique: list[Any] = []
    for param in params:
        if not any(_same(param, seen) for seen in unique):
            unique.append(param)
    return unique


# `make test` runs the suite in two pytest-xdist workers with `--dist loadfile`: each file in one worker, so that
# a module's set-up (a warmed-up forkserver, an envpool batch) runs once. A Ray test, though, goes to the worker
# that runs the other Ray tests, whatever its file: each worker would start a local Ray of its own (seconds of
# CPU, two more CPUs' worth of Ray workers on the machine). That group goes out first: it is the longest.
RAY_GROUP = "Ray tests"
# the ray2 placement among the test's parameters, or a docs block that starts Ray (tests/test_docs.py: page:line-ray)
_RAY_ID = re.compile(r"\[(?:[^\]]*-)?ray\d+(?:-[^\]]*)?\]$|\[[^\]]*:\d+-ray\]$")


def xdist_scope(nodeid: str) -> str:
    """The unit of work that a test id goes to a worker with: the Ray tests together, any other test with its file."""
    path = nodeid.split("::", 1)[0]
    if path == "tests/test_ray.py" or _RAY_ID.search(nodeid):
        return RAY_GROUP
    return path


def pytest_report_header(config: pytest.Config) -> str:
    """The CPU kernels the floats come from (``make test`` runs the float-sensitive files under a second set)."""
    import torch

    mkl = os.environ.get("MKL_CBWR", "unset")
    return f"CPU kernels: torch {torch.backends.cpu.get_cpu_capability()}, MKL_CBWR={mkl}"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--without-ray",
        action="store_true",
        help="deselect the Ray tests (tests/test_ray.py and every test on the Ray placement), most of the suite's "
        "CPU: `make test` runs the rest, `make test-ray` these",
    )
    parser.addoption(
        "--only-ray",
        action="store_true",
        help="select only the Ray tests, the ones that --without-ray deselects: `make test-ray`",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--without-ray") and config.getoption("--only-ray"):
        raise pytest.UsageError("--without-ray and --only-ray select nothing together: give one of them")
    if config.getoption("--without-ray"):
        items[:], ray = without_ray(items)
        config.hook.pytest_deselected(items=ray)
    elif config.getoption("--only-ray"):
        rest, items[:] = without_ray(items)
        config.hook.pytest_deselected(items=rest)


def without_ray(items: list[pytest.Item]) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """``(the items that do not start Ray actors, the Ray tests)``, each in the order of ``items``."""
    ray = [item for item in items if xdist_scope(item.nodeid) == RAY_GROUP]
    return [item for item in items if xdist_scope(item.nodeid) != RAY_GROUP], ray


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileAndRayScheduling(LoadFileScheduling):
        """Files to workers as ``--dist loadfile`` does, the Ray tests of every file as one unit, given out first."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if RAY_GROUP in self.workqueue:
                self.workqueue.move_to_end(RAY_GROUP, last=False)
            super()._assign_work_unit(node)

    return FileAndRayScheduling(config, log)


@pytest.fixture(autouse=True, scope="session")
def _stop_local_ray_at_the_end():
    yield
    stop_local_ray()
