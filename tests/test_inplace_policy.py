"""A policy that writes a tensor it was given in place is refused, on every placement and env kind.

The collector hands the policy tensors it keeps (a batch's rows, the next step's input, the
recurrent state it carries), so a write there would change the batch without a word. The
version counters of those tensors tell: the call ends with a ValueError naming the input and the fix.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from torch_rollout import Collector, Processes, envpool_envs

from placements import PLACEMENTS, local_ray, on_ray

FIX = "compute new tensors instead, e.g. obs = obs.clamp(-5, 5), not obs.clamp_(-5, 5)"


class Clamping(nn.Module):
    """Normalises its input as hand-written agents often do: in place."""

    def __init__(self, actions: int = 2) -> None:
        super().__init__()
        self.actions = actions
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        obs.clamp_(-0.01, 0.01)
        return {"action": torch.zeros(obs.shape[0], dtype=torch.long), "value": obs.sum(-1) + self.w}


class Subtracting(Clamping):
    """``obs -= self.mean``, also in place."""

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        obs -= 1.0
        return {"action": torch.zeros(obs.shape[0], dtype=torch.long), "value": obs.sum(-1) + self.w}


class WritingValue(Clamping):
    """A forward that leaves its input alone, and a bootstrap (``get_value``) that does not."""

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": torch.zeros(obs.shape[0], dtype=torch.long), "value": obs.sum(-1) + self.w}

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return obs.div_(255).sum(-1)


class WritingState(nn.Module):
    """A recurrent policy that advances its state in place instead of returning the next one as new tensors."""

    def forward(self, obs: torch.Tensor, state: TensorDict, is_init: torch.Tensor) -> dict:
        steps = state["steps"]
        steps.add_(1)
        return {"action": torch.zeros(obs.shape[0], dtype=torch.long), "next_state": {"steps": steps}}


def steps_state(num_envs: int) -> TensorDict:
    return TensorDict({"steps": torch.zeros(num_envs, 1)}, batch_size=[num_envs])


def collect(envs, policy, placement, **kwargs) -> None:
    if on_ray(placement):
        local_ray()
    options = {"num_envs": 4, "num_steps": 8, "device": "cpu", "seed": 0, "timeout": 120.0, **placement, **kwargs}
    with Collector(envs, policy, **options) as collector:
        for _ in zip(range(3), collector):
            pass


@pytest.mark.ray
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("policy", [Clamping, Subtracting], ids=["clamp_", "isub"])
def test_a_forward_that_writes_its_observations_is_refused(placement, policy):
    with pytest.raises(ValueError, match=re.escape(f"policy's forward ({policy.__name__}) wrote its input 'obs'")) as e:
        collect("CartPole-v1", policy(), placement)
    assert FIX in str(e.value)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
    "envs",
    [
        "torch_rollout/CartPole-v1",
        pytest.param(
            "envpool",
            marks=pytest.mark.skipif(importlib.util.find_spec("envpool") is None, reason="EnvPool is not installed"),
            id="envpool",
        ),
    ],
    ids=["torch_envs", "envpool"],
)
def test_every_env_kind_refuses_it(placement, envs):
    if envs == "envpool":
        envs = envpool_envs("CartPole-v1")
    with pytest.raises(ValueError, match=re.escape("wrote its input 'obs' in place")):
        collect(envs, Clamping(), placement)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_bootstrap_that_writes_the_waiting_observation_is_refused(placement):
    # The first forward writes nothing; the value call at the batch's end writes the next batch's input.
    with pytest.raises(ValueError, match=re.escape("policy's get_value (WritingValue) wrote its input 'obs'")):
        collect("CartPole-v1", WritingValue(), placement)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_recurrent_policy_that_writes_its_state_is_refused(placement):
    with pytest.raises(ValueError, match=re.escape("wrote its input 'steps' in place")):
        collect("CartPole-v1", WritingState(), placement, initial_state=steps_state)


def test_a_dict_observation_names_the_entry_written():
    import gymnasium as gym

    class DictClamping(nn.Module):
        def forward(self, obs: TensorDict) -> dict[str, torch.Tensor]:
            obs["position"].clamp_(-0.01, 0.01)
            return {"action": torch.zeros(obs.shape[0], dtype=torch.long)}

    def make(num_envs: int) -> gym.vector.VectorEnv:
        def one() -> gym.Env:
            env = gym.make("CartPole-v1")
            space = gym.spaces.Dict({"position": env.observation_space})
            return gym.wrappers.TransformObservation(env, lambda obs: {"position": obs}, space)

        return gym.vector.SyncVectorEnv([one] * num_envs)

    with pytest.raises(ValueError, match=re.escape("wrote its input 'obs.position' in place")):
        collect(make(4), DictClamping(), {"backend": "thread"}, num_envs=None)


def test_a_policy_that_leaves_its_input_alone_collects_as_before():
    class Copying(Clamping):
        def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
            obs = obs.clamp(-0.01, 0.01)
            return {"action": torch.zeros(obs.shape[0], dtype=torch.long), "value": obs.sum(-1) + self.w}

    with Collector("CartPole-v1", Copying(), num_envs=2, num_steps=4, device="cpu", seed=0, backend="thread") as c:
        batch = next(iter(c))
    # the stored observations are the env's, not the clamped copy
    assert batch["obs"].abs().max() > 0.01


def test_processes_report_it_from_the_worker():
    with pytest.raises(ValueError, match="wrote its input 'obs' in place") as e:
        collect("CartPole-v1", Clamping(), {"backend": Processes(1)})
    assert "worker" in "".join(getattr(e.value, "__notes__", [])) + str(e.value.__cause__)


def test_an_envs_inference_tensors_reach_the_policy_and_a_write_there_is_torchs_own_error():
    """Isaac Lab steps under torch.inference_mode(): its observations have no version counter to read."""
    from torch_rollout.loop._acting import PolicyCall, call_policy

    with torch.inference_mode():
        obs = torch.zeros(2, 4)

    class Reading(nn.Module):
        def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"action": torch.zeros(obs.shape[0], dtype=torch.long), "value": obs.sum(-1)}

    assert call_policy(Reading(), PolicyCall(obs))["value"].shape == (2,)
    with torch.no_grad(), pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        call_policy(Clamping(), PolicyCall(obs))
