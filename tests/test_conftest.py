"""The suite's own set-up: how `make test` shares the tests among pytest-xdist's workers."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from conftest import RAY_GROUP, _on_ray, pytest_collection_modifyitems, xdist_scope

from placements import PLACEMENTS


@pytest.mark.parametrize(
    "params",
    [["{placement}"], ["{placement}", "prefetch1"], ["prefetch1", "{placement}"], ["a", "{placement}", "b"]],
    ids=["alone", "first", "last", "between"],
)
def test_a_test_on_ray_goes_with_the_ray_tests_and_any_other_with_its_file(params):
    for placement in PLACEMENTS:
        nodeid = f"tests/test_x.py::test_y[{'-'.join(params).format(placement=placement.id)}]"
        expected = RAY_GROUP if placement.id == "ray2" else "tests/test_x.py"
        assert xdist_scope(nodeid) == expected, nodeid
    for nodeid in ["tests/test_x.py::test_array2", "tests/test_x.py::test_y[array2]", "tests/test_x.py::test_y[ray]"]:
        assert xdist_scope(nodeid) == "tests/test_x.py", nodeid
    assert xdist_scope("tests/test_ray.py::test_y") == RAY_GROUP  # every test there starts the local Ray
    assert xdist_scope("torch_rollout/gae.py::torch_rollout.gae.compute_gae") == "torch_rollout/gae.py"


def test_the_collected_tests_go_to_the_ray_group_exactly_when_they_run_on_ray(request):
    items = request.session.items
    wrong = [
        item.nodeid
        for item in items
        if (xdist_scope(item.nodeid) == RAY_GROUP)
        != (_on_ray(item) or _ray_file(item) or _docs_block_imports_ray(item))
    ]
    assert wrong == []


def _ray_file(item: pytest.Item) -> bool:
    return item.nodeid.startswith("tests/test_ray.py::")


def _docs_block_imports_ray(item: pytest.Item) -> bool:
    """A block of the docs whose code imports Ray (tests/test_docs.py): it starts a local Ray."""
    callspec = getattr(item, "callspec", None)
    code = (
        callspec.params.get("code", "") if callspec is not None and item.nodeid.startswith("tests/test_docs.py") else ""
    )
    return bool(re.search(r"^import ray$|^from ray[ .]", code, re.MULTILINE))


@pytest.mark.parametrize("option", ["--without-ray", "--only-ray", None])
def test_without_ray_and_only_ray_split_the_items_keeping_their_order(option):
    ids = [
        "tests/test_x.py::test_y[thread]",
        "tests/test_x.py::test_y[ray2]",
        "tests/test_ray.py::test_z",
        "tests/test_x.py::test_w[prefetch1-ray2]",
        "tests/test_x.py::test_w[prefetch1-process2]",
    ]
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in ids]
    deselected = []
    config = SimpleNamespace(
        getoption=lambda name: name == option,
        hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)),
    )
    pytest_collection_modifyitems(config, items)
    ray, rest = ids[1:4], [ids[0], ids[4]]
    if option == "--without-ray":
        assert [item.nodeid for item in items] == rest and [item.nodeid for item in deselected] == ray
    elif option == "--only-ray":
        assert [item.nodeid for item in items] == ray and [item.nodeid for item in deselected] == rest
    else:
        assert [item.nodeid for item in items] == ids and deselected == []


def test_without_ray_and_only_ray_together_are_refused():
    config = SimpleNamespace(getoption=lambda name: True, hook=None)
    with pytest.raises(pytest.UsageError, match="--without-ray and --only-ray select nothing together"):
        pytest_collection_modifyitems(config, [])
