"""compile_policy: the acting policy through torch.compile, in every local placement."""

from __future__ import annotations

import re
import time
from functools import partial

import pytest
import torch
from gymnasium.vector import AutoresetMode
from torch import nn

from torch_rollout import Collector

from counting_env import make_counting_envs
from placements import LOCAL_PLACEMENTS, envs_for, num_loops

_torch_dynamo = pytest.importorskip("torch._dynamo")
# The thread and one worker process: a second worker fails the same way (and costs seconds to start).
ONE_LOOP_PLACEMENTS = [param for param in LOCAL_PLACEMENTS if num_loops(param.values[0]) == 1]


class TwoScalePolicy(nn.Module):
    """Deterministic on CountingEnv: actions are a function of obs, values ``value_fn(obs) * a``.

    Outputs both weights per env: a row with ``a != b`` saw two weight versions.
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(1.0))
        self.b = nn.Parameter(torch.tensor(1.0))

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        n = obs.shape[0]
        action = (obs[:, 0] + obs[:, 1] + obs[:, 2]).long() % 3
        return {"action": action, "value": self.get_value(obs), "a": self.a.expand(n) + 0, "b": self.b.expand(n) + 0}

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return (0.01 * obs[:, 0] + 0.1 * obs[:, 1] + 0.5 * obs[:, 2] + 0.3 * obs[:, 3]) * self.a


def _collect(placement: dict, compile_policy: bool | dict) -> list:
    """Three SAME_STEP batches of 3 CountingEnvs (bootstraps of 1 and 2 envs), updating the weights after each."""
    policy = TwoScalePolicy()
    make_envs = partial(make_counting_envs, mode=AutoresetMode.SAME_STEP)
    envs, extra = envs_for(placement, make_envs, 3)
    batches = []
    with Collector(
        envs,
        policy,
        num_steps=8,
        total_timesteps=8 * 3 * 3,
        device="cpu",
        seed=0,
        compile_policy=compile_policy,
        **placement,
        **extra,
    ) as collector:
        for batch in collector:
            batches.append(batch)
            with torch.no_grad():  # the trainer's update: one parameter at a time, slowly
                policy.a.add_(1.0)
                time.sleep(0.005)
                policy.b.add_(1.0)
    if not extra:
        envs.close()
    return batches


@pytest.mark.parametrize("placement", LOCAL_PLACEMENTS)
def test_compiled_policy_gives_the_eager_batches_and_takes_every_refresh(placement):
    graphs = _torch_dynamo.utils.counters["stats"]["unique_graphs"]
    # Inductor's C++ compile takes seconds per process: worker processes compile with AOTAutograd alone, which
    # traces the same graphs (the weights as their inputs, the padded bootstraps) and runs them without codegen.
    compile_policy = True if placement["backend"] == "thread" else {"backend": "aot_eager"}
    eager, compiled = _collect(placement, False), _collect(placement, compile_policy)
    lockstep = placement["backend"] == "thread"  # prefetch=0: the rows' weight versions are fixed
    for before, after in zip(eager, compiled, strict=True):
        for key in ("obs", "action", "reward", "terminated", "truncated", "mask", "episode_return", "episode_length"):
            assert torch.equal(before[key], after[key]), key
        # The refresh reaches the compiled graphs (the weights are their inputs), never half of it.
        assert torch.equal(after["a"], after["b"]), "a row saw two weight versions"
        # version 0 (rows collected ahead before the first refresh) and version 1 both hold the initial a = 1
        assert torch.equal(after["a"], after["policy_version"].clamp(min=1).float())
        torch.testing.assert_close(after["value"] / after["a"], before["value"] / before["a"])
        if lockstep:
            for key in ("value", "next_value", "advantage", "return", "policy_version"):
                torch.testing.assert_close(after[key], before[key], rtol=1e-6, atol=0.0, msg=key)
    if placement["backend"] == "thread":
        # forward and get_value at [num_envs, ...] only: bootstraps of 1 or 2 of the 3 envs are padded
        assert _torch_dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= 2


class CompileFails(Exception):
    """Raised by the test's torch.compile backend."""


def failing_backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> None:
    """A torch.compile backend that fails, as Inductor does without a C++ compiler."""
    raise CompileFails("no C++ compiler here")


@pytest.mark.parametrize("placement", ONE_LOOP_PLACEMENTS)
def test_compile_failure_reaches_next_naming_the_option(placement):
    envs, extra = envs_for(placement, make_counting_envs, 2)
    with Collector(
        envs,
        TwoScalePolicy(),
        num_steps=4,
        device="cpu",
        compile_policy={"backend": failing_backend},
        **placement,
        **extra,
    ) as collector:
        with pytest.raises(RuntimeError, match=r"compile_policy=.*no C\+\+ compiler here.*pass compile_policy=False"):
            next(iter(collector))
    if not extra:
        envs.close()


@pytest.mark.parametrize(
    "compile_policy, error, match",
    [
        ("yes", TypeError, "compile_policy must be a bool or a dict of torch.compile keyword arguments"),
        ({"bogus": 1}, ValueError, "compile_policy={'bogus': 1} are not valid torch.compile keyword arguments"),
        ({"backend": "no-such-backend"}, ValueError, "are not valid torch.compile keyword arguments"),
    ],
    ids=["not-a-dict", "unknown-name", "unknown-backend"],
)
def test_bad_compile_policy_is_refused(compile_policy, error, match):
    with pytest.raises(error, match=re.escape(match)):
        Collector(
            make_counting_envs(2),
            TwoScalePolicy(),
            num_steps=4,
            device="cpu",
            backend="thread",
            compile_policy=compile_policy,
        )


def _recurrent_policy() -> tuple[nn.Module, dict]:
    from recurrent_policies import StepCountingValuePolicy, steps_state

    return StepCountingValuePolicy(), {"initial_state": steps_state}


def _tensordict_policy() -> tuple[nn.Module, dict]:
    from tensordict.nn import TensorDictModule

    from recurrent_policies import _Head

    torch.manual_seed(0)
    return TensorDictModule(_Head(4), in_keys=["obs"], out_keys=["action", "value"]), {}


@pytest.mark.parametrize("make_policy", [_recurrent_policy, _tensordict_policy], ids=["recurrent", "tensordict-module"])
def test_compiled_recurrent_and_tensordict_policies_give_the_eager_batches(make_policy):
    # SAME_STEP: padded bootstraps carry the state of the envs that ended. AOTAutograd alone (no C++ compile).
    batches = {}
    for compile_policy in (False, {"backend": "aot_eager"}):
        policy, extra = make_policy()
        envs = make_counting_envs(3, AutoresetMode.SAME_STEP)
        with Collector(
            envs,
            policy,
            num_steps=6,
            total_timesteps=6 * 3 * 2,
            device="cpu",
            seed=0,
            backend="thread",
            compile_policy=compile_policy,
            **extra,
        ) as collector:
            batches[bool(compile_policy)] = list(collector)
        envs.close()
    for before, after in zip(batches[False], batches[True], strict=True):
        assert set(before.keys(True, True)) == set(after.keys(True, True))
        for key in before.keys(True, True):
            torch.testing.assert_close(after[key], before[key], rtol=1e-6, atol=1e-6, msg=str(key))
