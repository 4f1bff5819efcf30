"""Session-wide set-up for the Ray placement: fewer combinations on Ray, and its local Ray stopped at the end."""

from __future__ import annotations

from typing import Any

import pytest

from placements import stop_local_ray

# A Ray actor starts in a fresh interpreter that imports torch and tensordict (seconds of CPU each), where a
# worker process forks from a preloaded server: the parametrized tests run on Ray in these combinations
# only (test -> parameter -> the values kept), chosen so that every autoreset mode, prefetch 0 and the
# deepest prefetch, and each kind of fault still run there.
RAY_COMBINATIONS: dict[str, dict[str, tuple[Any, ...]]] = {
    "test_every_transition_once_and_in_order": {"prefetch": (3,)},
    "test_no_row_mixes_two_weight_versions": {"prefetch": (0, 3)},
    "test_no_torn_weights_and_bounded_lag_while_trainer_updates": {"prefetch": (1,)},
    "test_replaced_policy_parameters_are_followed_or_named": {"how": ("load_state_dict-assign", "new-shape")},
    "test_check_finite_catches_non_finite_box_actions": {"bad": ("nan",)},
    "test_sub_env_observation_of_wrong_shape_async_names_the_env": {"shared_memory": (True,)},
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="a combination left to the local placements (Ray actors start in seconds)")
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("placement", {}).get("backend") != "ray":
            continue
        kept = RAY_COMBINATIONS.get(item.originalname, {})
        for name, values in kept.items():
            value = callspec.params.get(name)
            if str(value) not in map(str, values):
                item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _stop_local_ray_at_the_end():
    yield
    stop_local_ray()
