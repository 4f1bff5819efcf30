"""Session-wide set-up: fewer combinations on Ray, its local Ray stopped at the end, and SIGINT caught."""

from __future__ import annotations

import enum
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
# worker process forks from a preloaded server. So the parametrized tests run on Ray only where Ray's own
# code is at stake (weights riding with requests, shares concatenated in order, errors and their env
# indices coming back from actors, AsyncVectorEnv inside an actor), in these combinations (test ->
# parameter -> the values kept); the trainer-side logic they share is tested on the local placements
# (left out here as the same code on every placement: the loop's finite checks, and a replaced
# parameter of a new shape, which the trainer refuses).
RAY_RUNS: dict[str, dict[str, tuple[Any, ...]]] = {
    "test_every_transition_once_and_in_order": {"prefetch": (3,), "mode": ("NextStep",)},
    "test_no_row_mixes_two_weight_versions": {"prefetch": (3,)},
    "test_update_policy_refreshes_mid_iteration": {},
    "test_acting_policy_runs_on_one_intra_op_thread_and_the_trainer_keeps_its_own": {},
    "test_replaced_policy_parameters_are_followed_or_named": {"how": ("load_state_dict-assign",)},
    "test_async_env_error_reaches_consumer_when_warnings_are_errors": {},
    "test_cuda_batches_match_cpu": {"prefetch": (1,), "mode": ("NextStep",)},
    "test_a_resumed_collector_counts_on_and_continues_the_seed_stream": {},
    "test_state_counts_steps_since_episode_start_on_every_row": {
        "policy_cls": ("StepCountingValuePolicy",), "mode": ("SameStep",), "prefetch": (1,),
    },
    "test_infos_are_those_of_each_rows_step": {"mode": ("NextStep",)},
    "test_env_error_in_a_worker_reaches_next_with_its_traceback": {},
    "test_batches_are_those_of_one_vector_env": {"prefetch": (1,)},
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="left to the local placements on Ray (its actors take seconds to start)")
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or not on_ray(callspec.params.get("placement", {})):
            continue
        kept = RAY_RUNS.get(item.originalname)
        if kept is None or any(
            str(_value(callspec.params.get(name))) not in map(str, values) for name, values in kept.items()
        ):
            item.add_marker(skip)


def _value(param: Any) -> Any:
    """A parameter as the table names it: an enum (an autoreset mode) by its value, a class by its name."""
    if isinstance(param, type):
        return param.__name__
    return param.value if isinstance(param, enum.Enum) else param


@pytest.fixture(autouse=True, scope="session")
def _stop_local_ray_at_the_end():
    yield
    stop_local_ray()
