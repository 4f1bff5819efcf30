"""The plain steps (torch_rollout.loop._fused) write what the loop's general step writes, value for value."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from gymnasium.vector import AutoresetMode

from torch_rollout import BatchKeys, Collector, Processes
from torch_rollout.envs._numpy import NumpyEnvs

from counting_env import CountingPolicy, make_counting_envs

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


def _batches(
    mode: AutoresetMode,
    backend: object,
    *,
    general: bool,
    num_steps: int,
    deterministic: bool = False,
    scribble: bool = False,
) -> list[dict]:
    """Four batches of 3 CountingEnvs, each key cloned; ``general``: through the loop's general step, which
    ``check_finite=True`` takes (it changes no value of a batch without NaNs); ``scribble``: each batch's rows
    overwritten in place once cloned, as a trainer may (the batch is its own)."""
    torch.manual_seed(7)  # the policy draws its actions in this process: both runs draw the same ones
    collector = Collector(
        partial(make_counting_envs, mode=mode),
        CountingPolicy(deterministic=deterministic),
        num_envs=3,
        num_steps=num_steps,
        keys=BatchKeys(next_obs=True),
        seed=5,
        backend=backend,
        prefetch=0,
        check_finite=general,
    )
    with collector:
        got = []
        for _, batch in zip(range(4), collector, strict=False):
            got.append({key: value.clone() for key, value in batch.items(include_nested=True, leaves_only=True)})
            if scribble:
                for value in batch.values(include_nested=True, leaves_only=True):
                    value.fill_(True if value.dtype == torch.bool else -3)
    return got


@pytest.mark.parametrize("num_steps", [1, 5], ids=["T=1", "T=5"])
@pytest.mark.parametrize("mode", MODES, ids=[mode.value for mode in MODES])
def test_the_plain_steps_write_the_general_steps_batches(mode, num_steps, monkeypatch):
    calls = []
    step_into_rows = NumpyEnvs.step_into_rows

    def counted(self, *args):
        calls.append(1)
        return step_into_rows(self, *args)

    monkeypatch.setattr(NumpyEnvs, "step_into_rows", counted)
    plain = _batches(mode, "thread", general=False, num_steps=num_steps)
    taken = len(calls)
    general = _batches(mode, "thread", general=True, num_steps=num_steps)
    # Every step of the batches after the first (whose first step makes the policy's first call) on the plain
    # path; none with the finite checks.
    assert taken == 3 * num_steps and len(calls) == taken
    assert len(plain) == len(general) == 4
    for ours, theirs in zip(plain, general, strict=True):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=["next_step", "same_step"])
def test_a_worker_process_writes_the_same_batches_on_the_plain_steps(mode):
    # Actions from the observations: a worker draws from its own generator.
    plain = _batches(mode, Processes(num_workers=1), general=False, num_steps=5, deterministic=True)
    general = _batches(mode, "thread", general=True, num_steps=5, deterministic=True)
    for ours, theirs in zip(plain, general, strict=True):
        for key in theirs:
            assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("num_steps", [1, 5], ids=["T=1", "T=5"])
@pytest.mark.parametrize("mode", MODES, ids=[mode.value for mode in MODES])
def test_a_trainer_that_writes_its_batches_changes_no_later_batch(mode, num_steps):
    # The plain steps keep the running episode totals in the last row they wrote until the batch ends.
    written = _batches(mode, "thread", general=False, num_steps=num_steps, scribble=True)
    general = _batches(mode, "thread", general=True, num_steps=num_steps)
    for ours, theirs in zip(written, general, strict=True):
        for key in theirs:
            assert torch.equal(ours[key], theirs[key]), key
