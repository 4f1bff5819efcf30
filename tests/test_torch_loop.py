"""Vector envs of torch tensors: the batches of the NumPy path, row for row, with no host sync per step.

The reference for every check is the same env seen through :class:`NumpyView`,
which presents its tensors as NumPy arrays (and SAME_STEP final observations in
gymnasium's per-env layout), so that the collector's NumPy loop, tested exact
elsewhere, collects it. Both see the same dynamics, seeds and policy.
"""

from __future__ import annotations

import functools
import re
import types
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, VectorEnv, VectorWrapper
from tensordict import TensorDict
from torch import nn

from torch_rollout import GAE, BatchKeys, Collector
from torch_rollout.envs import CartPole, FromIsaacLab, FromRslRl, Pendulum

from placements import PLACEMENTS, local_ray, on_ray
from rowwise import RowwiseLinear

T, N = 7, 6  # T is prime to the time limit below: episode ends fall on batch boundaries too
MAX_STEPS = 9
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
TIMEOUT = 60.0
KEYS = (
    "obs",
    "action",
    "reward",
    "terminated",
    "truncated",
    "done",
    "mask",
    "episode_return",
    "episode_length",
    "value",
    "next_value",
    "advantage",
    "return",
)
# when a row was acted differs between runs that collect ahead (prefetch > 0), not what it holds


FINAL_OBS_KEYS = ("final_obs", "_final_obs", "final_observation", "_final_observation")


def _numpy(value: Any) -> Any:
    return {k: _numpy(v) for k, v in value.items()} if isinstance(value, dict) else value.numpy()


class NumpyView(VectorEnv):
    """A torch-tensor vector env presented with NumPy arrays, as gymnasium's own vector envs are (no ``device``)."""

    def __init__(self, envs: VectorEnv) -> None:
        self.envs = envs
        self.num_envs = envs.num_envs
        self.single_observation_space, self.observation_space = envs.single_observation_space, envs.observation_space
        self.single_action_space, self.action_space = envs.single_action_space, envs.action_space
        self.metadata = dict(envs.metadata)
        self.autoreset_mode = envs.metadata["autoreset_mode"]

    def reset(self, *, seed: Any = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        if options and "reset_mask" in options:
            options = {"reset_mask": torch.as_tensor(options["reset_mask"])}
        obs, infos = self.envs.reset(seed=seed, options=options)
        return obs.numpy(), {}

    def step(self, actions: np.ndarray) -> tuple:
        obs, reward, terminated, truncated, infos = self.envs.step(torch.as_tensor(actions))
        out = {key: _numpy(value) for key, value in infos.items() if key not in FINAL_OBS_KEYS}
        for key in FINAL_OBS_KEYS[::2]:
            if key in infos:  # gymnasium's per-env layout: an object array, None where no episode ended
                ended = infos["_" + key].numpy()
                final = np.empty(self.num_envs, dtype=object)
                for i in np.flatnonzero(ended):
                    final[i] = infos[key][i].numpy()
                out["final_obs"], out["_final_obs"] = final, ended
        return obs.numpy(), reward.numpy(), terminated.numpy(), truncated.numpy(), out

    def close_extras(self, **kwargs: Any) -> None:
        self.envs.close()


class LinearPolicy(nn.Module):
    """A deterministic policy of the observation: actions and values from one seeded linear layer.

    Its layer computes each row alone (RowwiseLinear): the same floats whatever rows a call has, so that the
    batches of two placements or of two ways to value final observations are compared bit for bit on any CPU.
    """

    def __init__(self, obs_dim: int = 4, continuous: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = RowwiseLinear(obs_dim, 2)
        self.continuous = continuous

    def forward(self, obs: torch.Tensor) -> dict:
        out = self.layer(obs)
        action = 3.0 * out[:, :1] if self.continuous else (out[:, 0] > 0).long()  # Box actions beyond the bounds
        return {"action": action, "value": out[:, 1], "log_prob": obs.sum(-1)}


class RecurrentLinearPolicy(LinearPolicy):
    """A recurrent policy whose state is a decaying sum of observations; values read the state."""

    def forward(self, obs: torch.Tensor, state: TensorDict, is_init: torch.Tensor) -> dict:
        out = super().forward(obs)
        h = torch.where(is_init.unsqueeze(-1), state["h"], state["h"])  # the collector resets h; is_init is a check
        out["value"] = out["value"] + h.sum(-1)
        out["next_state"] = {"h": 0.5 * h + obs[:, :2]}
        return out


def h_state(num_envs: int) -> TensorDict:
    return TensorDict({"h": torch.full((num_envs, 2), 0.25)}, batch_size=[num_envs])


def make_cartpole(num_envs: int, mode: AutoresetMode = AutoresetMode.NEXT_STEP, key: str = "final_obs") -> CartPole:
    return CartPole(num_envs, autoreset_mode=mode, max_episode_steps=MAX_STEPS, final_obs_key=key)


def collect(envs: Any, policy: nn.Module, batches: int = 4, **kwargs: Any) -> list[TensorDict]:
    options = dict(num_steps=T, device="cpu", seed=5, timeout=TIMEOUT, total_timesteps=batches * T * N)
    options.setdefault("num_envs", None if isinstance(envs, VectorEnv) else N)
    with Collector(envs, policy, **{**options, **kwargs}) as collector:
        return list(collector)


# Floats a policy or GAE computes: another device sums and fuses them in another order (cuBLAS, nvcc's FMAs).
COMPUTED = ("value", "next_value", "advantage", "return", "log_prob")


def assert_same_batches(
    got: list[TensorDict], expected: list[TensorDict], keys: tuple[str, ...] = KEYS, *, computed_close: bool = False
) -> None:
    """Exact equality; with ``computed_close``, the policy's and GAE's floats within float32 tolerances."""
    assert len(got) == len(expected)
    for b, (g, e) in enumerate(zip(got, expected)):
        for key in keys:
            exact = not (computed_close and key in COMPUTED)
            tolerance = dict(rtol=0, atol=0) if exact else {}
            torch.testing.assert_close(g[key], e[key], **tolerance, msg=lambda m, key=key, b=b: f"{key}, {b}: {m}")


# The autoreset modes, SAME_STEP with both names of the final observations (gymnasium's and ManiSkill3's).
MODES_AND_KEYS = [
    pytest.param(AutoresetMode.NEXT_STEP, "final_obs", id="next_step"),
    pytest.param(AutoresetMode.SAME_STEP, "final_obs", id="same_step-final_obs"),
    pytest.param(AutoresetMode.SAME_STEP, "final_observation", id="same_step-final_observation"),
    pytest.param(AutoresetMode.DISABLED, "final_obs", id="disabled"),
]


@pytest.mark.parametrize("prefetch", [0, 1], ids=lambda p: f"prefetch{p}")
@pytest.mark.parametrize(("mode", "key"), MODES_AND_KEYS)
def test_batches_are_those_of_the_numpy_path(mode, key, prefetch):
    """Every transition once and in order, masks, totals, bootstrap values of final observations, GAE."""
    policy, keys = LinearPolicy(), BatchKeys(next_obs=True)
    expected = collect(NumpyView(make_cartpole(N, mode, key)), policy, prefetch=prefetch, backend="thread", keys=keys)
    got = collect(make_cartpole(N, mode, key), policy, prefetch=prefetch, backend="thread", keys=keys)
    assert_same_batches(got, expected, keys=(*KEYS, "next_obs") if prefetch else (*KEYS, "next_obs", "policy_version"))
    assert all(isinstance(batch["obs"], torch.Tensor) for batch in got)
    done = torch.cat([batch["done"] for batch in got])
    assert done.any() and got[-1]["truncated"].any()  # episodes ended, time limits included
    assert torch.cat([batch["terminated"] for batch in got]).any()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_recurrent_state_and_box_actions_match_the_numpy_path(mode):
    """The state resets at episode starts, bootstraps use the state after the episode's last step; Box actions
    reach the env clipped to its bounds, while the batch keeps the policy's own."""
    policy = RecurrentLinearPolicy(obs_dim=3, continuous=True)
    pendulum = functools.partial(Pendulum, N, autoreset_mode=mode, max_episode_steps=MAX_STEPS)
    kwargs = dict(initial_state=h_state, backend="thread", prefetch=1, keys=BatchKeys(next_obs=True))
    expected = collect(NumpyView(pendulum()), policy, **kwargs)
    got = collect(pendulum(), policy, **kwargs)
    assert_same_batches(got, expected, keys=(*KEYS, "is_init", "h", "next_obs"))
    assert (torch.cat([b["action"] for b in got]).abs() > 2).any()  # beyond the bounds: clipped for the env only


@pytest.mark.parametrize("steps", [1, 3], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_short_batches_valued_densely_are_those_of_the_numpy_path(mode, steps):
    """Batches of a few steps value every env's final observation without a gather: the same values and next
    observations as the NumPy path's, feedforward and recurrent, across batch boundaries."""
    batches = 4 * T // steps  # episode ends inside batches and on their boundaries
    kwargs = dict(num_steps=steps, total_timesteps=batches * steps * N, backend="thread", keys=BatchKeys(next_obs=True))
    policy = LinearPolicy()
    expected = collect(NumpyView(make_cartpole(N, mode)), policy, **kwargs)
    assert_same_batches(collect(make_cartpole(N, mode), policy, **kwargs), expected, keys=(*KEYS, "next_obs"))
    recurrent = RecurrentLinearPolicy(obs_dim=3, continuous=True)
    pendulum = functools.partial(Pendulum, N, autoreset_mode=mode, max_episode_steps=MAX_STEPS)
    expected = collect(NumpyView(pendulum()), recurrent, initial_state=h_state, **kwargs)
    got = collect(pendulum(), recurrent, initial_state=h_state, **kwargs)
    assert_same_batches(got, expected, keys=(*KEYS, "is_init", "h", "next_obs"))
    assert torch.cat([batch["done"] for batch in got]).any()


@pytest.mark.ray
@pytest.mark.parametrize("placement", PLACEMENTS[1:])  # worker processes, Ray actors
def test_a_torch_env_recipe_runs_in_worker_processes_with_the_threads_batches(placement):
    """Env j is reset with seed + j and keeps its own episode stream wherever it steps."""
    if on_ray(placement):
        local_ray()
    recipe = functools.partial(make_cartpole, mode=AutoresetMode.SAME_STEP)
    keys = BatchKeys(next_obs=True)
    expected = collect(recipe(N), LinearPolicy(), backend="thread", prefetch=1, keys=keys)
    got = collect(recipe, LinearPolicy(), prefetch=1, keys=keys, **placement)
    assert_same_batches(got, expected, keys=(*KEYS, "next_obs"))


_SYNCS = ("item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__int__", "__float__", "__index__")


class SyncCounter:
    """Counts the calls that read a tensor's values back to the host (patched on torch.Tensor and torch)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, int] = {}
        self.on = False
        for name in _SYNCS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch, "nonzero", self._counting("torch.nonzero", torch.nonzero))
        monkeypatch.setattr(torch, "masked_select", self._counting("torch.masked_select", torch.masked_select))
        getitem = torch.Tensor.__getitem__

        def indexing(tensor: torch.Tensor, index: Any) -> Any:
            indices = index if isinstance(index, tuple) else (index,)
            if self.on and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.calls["boolean-mask indexing"] = self.calls.get("boolean-mask indexing", 0) + 1
            return getitem(tensor, index)

        monkeypatch.setattr(torch.Tensor, "__getitem__", indexing)

    def _counting(self, name: str, function: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.calls[name] = self.calls.get(name, 0) + 1
            return function(*args, **kwargs)

        return counted

    def count(self, iterator: Any) -> dict[str, int]:
        self.calls, self.on = {}, True
        try:
            next(iterator)
        finally:
            self.on = False
        return self.calls


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_no_host_sync_per_step(mode, monkeypatch):
    """The calls that read values back to the host are a fixed number per batch, whatever its number of steps."""
    counter = SyncCounter(monkeypatch)
    counts = {}
    for steps in (8, 16):  # past DENSE_FINALS_STEPS: final observations gathered once per batch
        envs = StepInfos(make_cartpole(N, mode))  # infos too
        keys = BatchKeys(info_keys=("x", "ends"), next_obs=True)
        with Collector(envs, LinearPolicy(), num_steps=steps, device="cpu", seed=1, backend="thread", keys=keys) as c:
            collector = c
            batches = iter(collector)
            next(batches)  # the first batch learns the policy's outputs
            counts[steps] = [counter.count(batches) for _ in range(3)]
    assert counts[8] == counts[16], counts  # 0 per step
    # At most the batch end's one nonzero, which gathers the final observations to value.
    expected = {} if mode == AutoresetMode.NEXT_STEP else {"nonzero": 1}
    assert counts[16] == [expected] * 3, counts


@pytest.mark.parametrize("keys", [BatchKeys(), BatchKeys(next_obs=True)], ids=["values", "values-next_obs"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_a_batch_of_one_step_makes_no_host_sync(mode, keys, monkeypatch):
    """Off-policy learners' T=1: final observations valued densely, so a steady-state batch reads nothing back."""
    counter = SyncCounter(monkeypatch)
    with Collector(
        make_cartpole(N, mode), LinearPolicy(), num_steps=1, device="cpu", seed=1, backend="thread", keys=keys
    ) as c:
        batches = iter(c)
        next(batches)  # the first batch learns the policy's outputs
        counts = [counter.count(batches) for _ in range(2 * MAX_STEPS)]  # episodes end meanwhile
    assert counts == [{}] * (2 * MAX_STEPS), counts


def test_envs_of_tensors_that_do_not_say_so_are_named():
    envs = make_cartpole(2)

    class Hidden(NumpyView):
        def reset(self, *, seed: Any = None, options: dict | None = None) -> tuple:
            return self.envs.reset(seed=seed, options=options)

    message = "Collector: envs.reset() returned torch tensors, but Hidden does not say that it presents torch tensors"
    with pytest.raises(TypeError, match=re.escape(message)):
        collect(Hidden(envs), LinearPolicy(), backend="thread")


def test_a_device_string_on_the_env_says_it_presents_torch_tensors_as_a_torch_device_does():
    policy = LinearPolicy()
    expected = collect(make_cartpole(N), policy, backend="thread")
    envs = make_cartpole(N)
    envs.device = "cpu"  # as some envs keep it
    assert_same_batches(collect(envs, policy, backend="thread"), expected)


class StepInfos(VectorWrapper):
    """Infos of tensors: the returned cart position and a nested dict; SAME_STEP's final_info holds the ended step's."""

    def step(self, actions: Any) -> tuple:
        obs, reward, terminated, truncated, infos = self.env.step(actions)
        ones = torch.ones(self.num_envs, dtype=torch.bool)
        infos = {**infos, "x": obs[:, 0].double(), "_x": ones, "ends": {"term": terminated}, "_ends": ones}
        if "final_obs" in infos:
            ended = infos["_final_obs"]
            final = infos["final_obs"]
            infos["final_info"] = {"x": final[:, 0].double(), "_x": ended, "ends": {"term": terminated}, "_ends": ended}
        return obs, reward, terminated, truncated, infos


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_infos_are_those_of_the_numpy_path(mode):
    """Each row's infos are its step's (SAME_STEP: final_info for the envs that ended), with their presence masks."""
    keys = BatchKeys(info_keys=("x", "ends"))
    expected = collect(NumpyView(StepInfos(make_cartpole(N, mode))), LinearPolicy(), backend="thread", keys=keys)
    got = collect(StepInfos(make_cartpole(N, mode)), LinearPolicy(), backend="thread", keys=keys)
    assert_same_batches(got, expected, keys=(*KEYS, "info"))
    info = got[0]["info"]
    assert info["x"].dtype == torch.float32 and info["ends", "term"].dtype == torch.bool


def test_infos_a_torch_env_lacks_are_named():
    with pytest.raises(ValueError, match=re.escape("Collector: info_keys names 'nope', but the first step's infos")):
        collect(make_cartpole(N), LinearPolicy(), backend="thread", keys=BatchKeys(info_keys=("nope",)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_cuda_collection_has_no_host_sync_and_matches_the_cpu(mode):
    policy = LinearPolicy()
    expected = collect(make_cartpole(N, mode), policy, backend="thread", prefetch=0)
    envs = CartPole(N, device="cuda", autoreset_mode=mode, max_episode_steps=MAX_STEPS)
    cuda_policy = LinearPolicy().cuda()
    with Collector(envs, cuda_policy, num_steps=T, device="cuda", seed=5, backend="thread", prefetch=0) as collector:
        batches = iter(collector)
        got = [next(batches)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            # Only the batch end's gathering of the rows that ended may sync: none in NEXT_STEP mode.
            if mode == AutoresetMode.NEXT_STEP:
                got += [next(batches) for _ in range(3)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        got += [next(batches) for _ in range(4 - len(got))]
    assert_same_batches([b.cpu() for b in got], expected, computed_close=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_cuda_batches_of_one_step_make_no_host_sync_and_match_the_cpu(mode):
    """T=1 on the device, values and next observations: no sync at all, in every autoreset mode."""
    policy, keys, batches = LinearPolicy(), BatchKeys(next_obs=True), 3 * MAX_STEPS
    options = dict(num_steps=1, total_timesteps=batches * N, backend="thread", prefetch=0, keys=keys)
    expected = collect(make_cartpole(N, mode), policy, **options)
    envs = CartPole(N, device="cuda", autoreset_mode=mode, max_episode_steps=MAX_STEPS)
    with Collector(envs, LinearPolicy().cuda(), device="cuda", seed=5, timeout=TIMEOUT, **options) as collector:
        it = iter(collector)
        got = [next(it)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got += [next(it) for _ in range(batches - 1)]  # episodes end meanwhile
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert_same_batches([b.cpu() for b in got], expected, keys=(*KEYS, "next_obs"), computed_close=True)


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


class SlowPolicy(LinearPolicy):
    """LinearPolicy behind a queue of GPU work: its actions land late, long after the forward has returned."""

    def forward(self, obs: torch.Tensor) -> dict:
        if obs.is_cuda:
            busy = torch.ones(2048, 2048, device=obs.device)
            for _ in range(20):  # milliseconds of kernels queued before the action's
                busy = (busy @ busy).clamp_(max=1.0)
            obs = obs + 0.0 * busy[0, 0]
        return super().forward(obs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_trainer_on_a_stream_of_its_own_reads_finished_batches(prefetch):
    """The collector's thread on its own stream, the trainer under ``torch.cuda.stream(s)`` with heavy kernels
    of its own: each batch, handed to ``s`` with an event, equals the CPU's."""
    expected = collect(make_cartpole(N), LinearPolicy(), backend="thread", prefetch=0)
    envs = CartPole(N, device="cuda", max_episode_steps=MAX_STEPS)
    trainer = torch.cuda.Stream()
    got = []
    with torch.cuda.stream(trainer):
        options = dict(num_steps=T, device="cuda", seed=5, backend="thread", prefetch=prefetch, timeout=TIMEOUT)
        with Collector(envs, SlowPolicy().cuda(), total_timesteps=4 * T * N, **options) as collector:
            for batch in collector:
                busy = torch.ones(2048, 2048, device="cuda")
                for _ in range(10):  # the trainer's own work, queued on its stream
                    busy = (busy @ busy).clamp_(max=1.0)
                got.append(batch.clone())  # on the trainer's stream, before the collector reuses any memory
        got = [batch.cpu() for batch in got]
    assert_same_batches(got, expected, computed_close=True)


@pytest.mark.parametrize("policy_device", ["cpu", CUDA])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_cpu_env_steps_on_the_actions_of_a_policy_elsewhere(policy_device, prefetch):
    """The env on the CPU, the policy on ``policy_device``: re-stepping a twin env with the batch's actions
    gives the batch's observations (an env that stepped on actions still in flight would not)."""
    device = torch.device(policy_device)
    envs = make_cartpole(N)
    keys = BatchKeys(next_obs=True)
    options = dict(num_steps=T, device=device, seed=5, backend="thread", prefetch=prefetch, keys=keys, timeout=TIMEOUT)
    with Collector(envs, SlowPolicy().to(device), total_timesteps=4 * T * N, **options) as collector:
        batches = [batch.cpu() for batch in collector]
    twin = make_cartpole(N)
    obs, _ = twin.reset(seed=5)
    torch.testing.assert_close(obs, batches[0]["obs"][0], rtol=0, atol=0)
    for b, batch in enumerate(batches):
        for t in range(T):
            obs, *_ = twin.step(batch["action"][t])
            torch.testing.assert_close(obs, batch["next_obs"][t], rtol=0, atol=0, msg=f"batch {b}, row {t}")


@pytest.mark.parametrize("env_device", ["cpu", CUDA])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_policy_on_the_cpu_bootstraps_from_the_final_observations_of_an_env_elsewhere(env_device, prefetch):
    """SAME_STEP, the env on ``env_device``, the policy on the CPU: ``next_value`` is the policy's value of the
    observation each step returned (the final one where an episode ended, from a twin env), recomputed eagerly."""
    env = torch.device(env_device)
    envs = CartPole(N, device=env, autoreset_mode=AutoresetMode.SAME_STEP, max_episode_steps=MAX_STEPS)
    policy = LinearPolicy()
    keys = BatchKeys(next_obs=True)
    options = dict(num_steps=T, device="cpu", seed=5, backend="thread", prefetch=prefetch, keys=keys, timeout=TIMEOUT)
    with Collector(envs, policy, total_timesteps=4 * T * N, **options) as collector:
        batches = list(collector)
    twin = CartPole(N, device=env, autoreset_mode=AutoresetMode.SAME_STEP, max_episode_steps=MAX_STEPS)
    twin.reset(seed=5)
    ended = 0
    for b, batch in enumerate(batches):
        for t in range(T):
            obs, _, terminated, truncated, infos = twin.step(batch["action"][t].to(env))
            done = (terminated | truncated).cpu()
            final = torch.where(done[:, None], infos["final_obs"].cpu(), obs.cpu())
            ended += int(done.sum())
            torch.testing.assert_close(batch["next_obs"][t], final, rtol=0, atol=0, msg=f"batch {b}, row {t}")
        with torch.no_grad():
            expected = policy(batch["next_obs"].reshape(T * N, -1))["value"].reshape(T, N)
        torch.testing.assert_close(batch["next_value"], expected)
    assert ended > 0


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


class DeviceProbe(LinearPolicy):
    """LinearPolicy that records the thread's current CUDA device at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.current: set[int] = set()

    def forward(self, obs: torch.Tensor) -> dict:
        self.current.add(torch.cuda.current_device())
        return super().forward(obs)


@TWO_GPUS
@pytest.mark.parametrize("unindexed", [False, True], ids=["cuda:1", "cuda-after-set_device"])
def test_a_collector_on_the_second_gpu_stays_there(unindexed, monkeypatch):
    """Rank 1 of torchrun: env, policy and thread on cuda:1, also when they were given plain ``"cuda"``."""
    second = torch.device("cuda", 1)
    previous = torch.cuda.current_device()
    torch.cuda.set_device(second)
    try:
        name = "cuda" if unindexed else second
        envs = CartPole(N, device=name, max_episode_steps=MAX_STEPS)
        assert envs.device == second
        policy = DeviceProbe().to(second)
        with Collector(
            envs,
            policy,
            num_steps=T,
            device=name,
            seed=5,
            backend="thread",
            prefetch=1,
            total_timesteps=2 * T * N,
            timeout=TIMEOUT,
        ) as collector:
            torch.cuda.set_device(0)  # the trainer's thread moves on; the collector's thread stays on cuda:1
            batches = list(collector)
    finally:
        torch.cuda.set_device(previous)
    assert policy.current == {1}
    assert all(batch["obs"].device == second and batch["next_value"].device == second for batch in batches)


class RslRlCartPole:
    """CartPole stepped the rsl_rl way: observation groups, resets inside step, dones and extras["time_outs"].

    ``layout``: ``"3.x"`` gives a TensorDict of groups; ``"2.x"`` the policy tensor with every group in
    ``extras["observations"]`` (Isaac Lab up to 2.1), ``"2.x-critic"`` with the critic group only there; ``"1.x"``
    steps as legged_gym does, ``(obs, privileged_obs, rewards, dones, extras)`` with the critic group as the
    privileged observations (from ``get_privileged_observations()`` too), dones as int64 and time-outs as floats
    (Genesis's locomotion examples), ``"1.x-none"`` the same with no privileged observations (``None``).
    ``final_obs``: puts the groups before the same-step reset in ``extras["final_obs"]`` (Isaac Lab's
    ``compute_final_obs``); ``declares``: ``cfg.compute_final_obs`` on ``unwrapped``, as Isaac Lab's wrapper has it.
    ``both``: the terminations of even envs reach their time limit too (``dones`` and ``time_outs`` both set, as
    Isaac Lab's ``RslRlVecEnvWrapper`` passes a step that both terminated and timed out); ``beneath``: where
    ``unwrapped`` keeps the flags apart: ``"buffers"`` in ``reset_terminated`` and ``reset_time_outs`` (Isaac Lab's
    ``DirectRLEnv``), ``"manager"`` in ``termination_manager.terminated`` and ``.time_outs`` (``ManagerBasedRLEnv``),
    ``None`` nowhere.
    ``finals`` keeps each step's true final observations and time-outs that bootstrap (not terminated), for the
    tests to value by hand.
    """

    def __init__(
        self,
        num_envs: int,
        *,
        layout: str = "3.x",
        final_obs: bool = False,
        declares: bool = False,
        both: bool = False,
        beneath: str | None = "buffers",
    ) -> None:
        self.envs = make_cartpole(num_envs, AutoresetMode.SAME_STEP)
        self.num_envs, self.device, self.num_actions = num_envs, self.envs.device, 1
        self.layout, self.final_obs, self.both = layout, final_obs, both
        self.unwrapped = types.SimpleNamespace(cfg=types.SimpleNamespace(compute_final_obs=declares))
        flags = types.SimpleNamespace(
            terminated=torch.zeros(num_envs, dtype=torch.bool), time_outs=torch.zeros(num_envs, dtype=torch.bool)
        )
        self.flags = flags
        if beneath == "buffers":  # DirectRLEnv's
            self.unwrapped.reset_terminated, self.unwrapped.reset_time_outs = flags.terminated, flags.time_outs
        elif beneath == "manager":  # ManagerBasedRLEnv's termination manager
            self.unwrapped.termination_manager = flags
        self.finals: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.both_flags: list[torch.Tensor] = []  # each step's envs that terminated and timed out
        self.obs, _ = self.envs.reset(seed=0)

    def groups(self, obs: torch.Tensor) -> TensorDict:
        return TensorDict({"policy": obs, "critic": 2 * obs}, batch_size=[self.num_envs])

    def get_observations(self) -> Any:
        groups = self.groups(self.obs)
        if self.layout == "3.x":
            return groups
        if self.layout.startswith("1.x"):
            return groups["policy"]
        others = {"critic": groups["critic"]} if self.layout == "2.x-critic" else dict(groups.items())
        return groups["policy"], {"observations": others}

    def get_privileged_observations(self) -> torch.Tensor | None:  # rsl_rl 1.x's; the other layouts never call it
        return self.groups(self.obs)["critic"] if self.layout == "1.x" else None

    def step(self, actions: torch.Tensor) -> tuple:
        self.obs, reward, terminated, truncated, infos = self.envs.step((actions[:, 0] > 0).long())
        self.finals.append((infos["final_obs"].clone(), truncated & ~terminated))
        if self.both:
            truncated = truncated | (terminated & (torch.arange(self.num_envs) % 2 == 0))
        self.both_flags.append(terminated & truncated)
        self.flags.terminated[:], self.flags.time_outs[:] = terminated, truncated  # in place, as Isaac Lab's
        extras = {"time_outs": truncated}
        if self.final_obs:
            extras["final_obs"] = self.groups(infos["final_obs"])
        if self.layout.startswith("1.x"):
            extras["time_outs"] = truncated.float()
            dones = (terminated | truncated).long()
            return self.get_observations(), self.get_privileged_observations(), reward, dones, extras
        obs = self.get_observations()
        if self.layout != "3.x":
            obs, more = obs
            extras.update(more)
        return obs, reward, terminated | truncated, extras


class GroupPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.actor, self.critic = nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, obs: TensorDict) -> dict:
        return {"action": self.actor(obs["policy"]), "value": self.critic(obs["critic"])}


class PlainPolicy(GroupPolicy):
    """GroupPolicy's layers on an observation without groups (an rsl_rl 1.x env without privileged ones)."""

    def forward(self, obs: torch.Tensor) -> dict:
        return {"action": self.actor(obs), "value": self.critic(obs)}


class CountingGroupPolicy(GroupPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []  # the rows of each call

    def forward(self, obs: TensorDict) -> dict:
        self.rows.append(obs.batch_size[0])
        return super().forward(obs)


@pytest.mark.parametrize("bootstrap", ["last_obs", "none"])
def test_rsl_rl_style_envs_bootstrap_time_outs_as_chosen_and_say_so(bootstrap):
    """V(s_t) bootstraps reuse the row's own value: equal to it bit for bit on any CPU, and no call of their own."""
    keys = BatchKeys(info_keys=("bootstrap",), next_obs=True)
    policy = CountingGroupPolicy()
    batches = collect(FromRslRl(RslRlCartPole(N), bootstrap=bootstrap), policy, seed=None, keys=keys, prefetch=0)
    # One forward of N rows a step, and one after each batch (the next batch's first observations): none for ends.
    assert policy.rows == [N] * (len(batches) * (T + 1))
    batch = torch.cat(batches)
    going_on = ~batch["done"][:-1]  # Dict observations: the next row's, where no episode ended
    assert (batch["next_obs"][:-1][going_on] == batch["obs"][1:][going_on]).all()
    assert isinstance(batch["obs"], TensorDict) and set(batch["obs"].keys()) == {"policy", "critic"}
    time_outs = batch["info", "bootstrap"] > 0
    assert time_outs.any() and batch["terminated"].any()
    if bootstrap == "last_obs":  # a time-out bootstraps from V(s_t): its own row's value (unless it terminated too)
        assert torch.equal(batch["truncated"] & ~batch["terminated"], time_outs)
        assert torch.equal(batch["next_value"][time_outs], batch["value"][time_outs])
        assert torch.equal(batch["info", "bootstrap"][time_outs], torch.ones(int(time_outs.sum()), dtype=torch.int8))
    else:  # a time-out ends like a termination, and stays a time-out
        assert batch["truncated"][time_outs].all() and batch["terminated"][time_outs].all()
        assert (batch["info", "bootstrap"][time_outs] == 2).all()
    exact = ~time_outs & ~batch["done"]
    torch.testing.assert_close(batch["next_value"][:-1][exact[:-1]], batch["value"][1:][exact[:-1]])
    ended = batch["terminated"]  # no bootstrap; next_value holds V(s_t), as the contract says
    assert torch.equal(batch["next_value"][ended], batch["value"][ended])


@pytest.mark.parametrize("layout", ["3.x", "2.x", "2.x-critic"])
def test_rsl_rl_style_envs_keep_every_observation_group(layout):
    """rsl_rl 2.x's critic observations (in extras["observations"]) reach the batch and the critic, as 3.x's do."""
    policy = GroupPolicy()
    batch = torch.cat(collect(FromRslRl(RslRlCartPole(N, layout=layout), bootstrap="last_obs"), policy, seed=None))
    obs = batch["obs"]
    assert isinstance(obs, TensorDict) and set(obs.keys()) == {"policy", "critic"}
    assert torch.equal(obs["critic"], 2 * obs["policy"])
    with torch.no_grad():
        torch.testing.assert_close(batch["value"], policy.critic(obs["critic"]).squeeze(-1))


@pytest.mark.parametrize("bootstrap", ["last_obs", "none"])
def test_rsl_rl_1x_envs_give_the_batches_of_the_same_env_stepped_as_rsl_rl_3x(bootstrap):
    """legged_gym's five values (privileged observations as the critic group, int dones, float time-outs): the rows
    of the same env stepped the 3.x way, bit for bit, time-outs bootstrapped and labelled as chosen."""
    keys = BatchKeys(info_keys=("bootstrap",), next_obs=True)
    runs = [
        collect(
            FromRslRl(RslRlCartPole(N, layout=layout, beneath=None), bootstrap=bootstrap),
            GroupPolicy(),
            seed=None,
            keys=keys,
        )
        for layout in ("1.x", "3.x")
    ]
    got, expected = (torch.cat(batches) for batches in runs)
    assert set(got["obs"].keys()) == {"policy", "critic"}
    for key in (*KEYS[1:], "obs", "next_obs", ("info", "bootstrap")):
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    time_outs = got["info", "bootstrap"] > 0
    assert time_outs.any() and got["terminated"].any() and torch.equal(got["truncated"], time_outs)
    assert torch.equal(got["next_value"][time_outs], got["value"][time_outs])  # V(s_t): the env keeps no final obs


def test_rsl_rl_1x_envs_without_privileged_observations_give_one_tensor():
    """privileged_obs None (Genesis's examples): the policy observation alone, no groups; the critic reads it."""
    policy = PlainPolicy()
    keys = BatchKeys(info_keys=("bootstrap",))
    envs = FromRslRl(RslRlCartPole(N, layout="1.x-none", beneath=None), bootstrap="last_obs")
    assert isinstance(envs.single_observation_space, gym.spaces.Box)
    batch = torch.cat(collect(envs, policy, seed=None, keys=keys))
    assert isinstance(batch["obs"], torch.Tensor) and batch["obs"].shape == (len(batch), N, 4)
    with torch.no_grad():
        torch.testing.assert_close(batch["value"], policy.critic(batch["obs"]).squeeze(-1))
    time_outs = batch["truncated"]
    assert time_outs.any() and torch.equal(batch["info", "bootstrap"], time_outs.to(torch.int8))
    assert torch.equal(batch["next_value"][time_outs], batch["value"][time_outs])


def test_rsl_rl_groups_missing_at_a_step_and_steps_of_other_shapes_are_refused_by_name():
    class Forgets(RslRlCartPole):
        def step(self, actions: torch.Tensor) -> tuple:
            obs, reward, dones, extras = super().step(actions)
            del extras["observations"]
            return obs, reward, dones, extras

    class PrivilegedAtSteps(RslRlCartPole):  # privileged observations at its steps, but not before them
        def get_privileged_observations(self) -> None:
            return None

        def step(self, actions: torch.Tensor) -> tuple:
            obs, _, reward, dones, extras = super().step(actions)
            return obs, 2 * obs, reward, dones, extras

    class NoExtras(RslRlCartPole):
        def step(self, actions: torch.Tensor) -> tuple:
            return super().step(actions)[:3]

    message = (
        "FromRslRl.step: env.step() returned one tensor, without groups as its observation, but get_observations() "
        "gave the groups ['critic', 'policy']; an rsl_rl 2.x env must put its other groups in extras['observations']"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        collect(FromRslRl(Forgets(N, layout="2.x"), bootstrap="none"), GroupPolicy(), seed=None)
    message = (
        "FromRslRl.step: env.step() returned the groups ['critic', 'policy'] as its observation, but "
        "get_observations() gave one tensor, without groups; an rsl_rl 1.x env must give privileged observations at "
        "every step or at none, and from get_privileged_observations() too"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        collect(FromRslRl(PrivilegedAtSteps(N, layout="1.x"), bootstrap="none"), PlainPolicy(), seed=None)
    message = (
        "FromRslRl.step: env.step() returned 3 values, expected 4, (obs, rewards, dones, extras) as rsl_rl 2.x and "
        "later step, or 5, (obs, privileged_obs, rewards, dones, extras) as rsl_rl 1.x steps"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        collect(FromRslRl(NoExtras(N), bootstrap="none"), GroupPolicy(), seed=None)


def _true_final_values(policy: GroupPolicy, env: RslRlCartPole, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[steps, N]`` V(true final observation) of each step, computed eagerly, and the time-outs."""
    finals = torch.stack([final for final, _ in env.finals[:steps]])
    time_outs = torch.stack([time_out for _, time_out in env.finals[:steps]])
    with torch.no_grad():
        return policy.critic(2 * finals).squeeze(-1), time_outs


@pytest.mark.parametrize(
    ("layout", "declares", "bootstrap"),
    [
        pytest.param("3.x", True, None, id="compute_final_obs"),
        pytest.param("2.x", True, None, id="compute_final_obs-2.x"),
        pytest.param("3.x", False, "final_obs", id="final_obs"),
        pytest.param("3.x", True, "none", id="final_obs-over-none"),
        pytest.param("1.x", False, "final_obs", id="final_obs-1.x"),
    ],
)
def test_rsl_rl_style_envs_bootstrap_time_outs_exactly_from_extras_final_obs(layout, declares, bootstrap):
    """With extras["final_obs"] a time-out's next_value is V(true final observation), labelled exact (0)."""
    env, policy = RslRlCartPole(N, layout=layout, final_obs=True, declares=declares), GroupPolicy()
    envs = FromRslRl(env, bootstrap=bootstrap)
    assert envs.bootstrap == (bootstrap or "final_obs")
    keys = BatchKeys(info_keys=("bootstrap",), next_obs=True)
    batch = torch.cat(collect(envs, policy, seed=None, keys=keys))
    expected, time_outs = _true_final_values(policy, env, len(batch))
    assert time_outs.any() and batch["terminated"].any()
    assert torch.equal(batch["truncated"] & ~batch["terminated"], time_outs)  # CartPole's own both-flags steps too
    assert not batch["info", "bootstrap"].any()  # every row exact
    torch.testing.assert_close(batch["next_value"][time_outs], expected[time_outs])
    assert not torch.allclose(batch["next_value"][time_outs], batch["value"][time_outs])  # not V(s_t)
    finals = torch.stack([final for final, _ in env.finals[: len(batch)]])
    done = batch["done"]
    assert torch.equal(batch["next_obs", "policy"][done], finals[done])
    assert torch.equal(batch["next_obs", "critic"][done], 2 * finals[done])


@pytest.mark.parametrize("beneath", ["buffers", "manager"])
@pytest.mark.parametrize("bootstrap", [None, "last_obs", "none"])
def test_rsl_rl_style_steps_that_terminate_at_the_time_limit_are_exact_where_the_env_beneath_says_so(
    bootstrap, beneath
):
    """dones and time_outs both set, where the env beneath says it terminated: both flags, no bootstrap, exact."""
    env = RslRlCartPole(N, final_obs=bootstrap is None, declares=True, both=True, beneath=beneath)
    policy = GroupPolicy()
    keys = BatchKeys(info_keys=("bootstrap",), next_obs=True)
    batch = torch.cat(collect(FromRslRl(env, bootstrap=bootstrap), policy, seed=None, keys=keys))
    both = torch.stack(env.both_flags[: len(batch)])
    expected, time_outs = _true_final_values(policy, env, len(batch))  # the time-outs that did not terminate
    marks = batch["info", "bootstrap"]
    assert both.any() and time_outs.any()
    assert batch["terminated"][both].all() and torch.equal(batch["truncated"], time_outs | both)
    assert not marks[both].any()  # terminations: exact whatever bootstrap says
    if bootstrap is None:
        assert not marks.any()
        torch.testing.assert_close(batch["next_value"][time_outs], expected[time_outs])
    elif bootstrap == "last_obs":
        assert torch.equal(marks, time_outs.to(torch.int8))
    else:
        assert torch.equal(batch["terminated"], batch["done"]) and torch.equal(marks, 2 * time_outs.to(torch.int8))


def _check_advantages_without_bootstrap_at_terminations(batches: list[TensorDict], gae: GAE) -> None:
    """Each batch's advantages against GAE's textbook loop in float64, in which a terminated row never bootstraps,
    whatever its ``truncated`` says."""
    for batch in batches:
        reward, value, next_value = (batch[key].double() for key in ("reward", "value", "next_value"))
        live, going_on = (~batch["terminated"]).double(), (~batch["done"]).double()
        advantage, carry = torch.zeros_like(value), torch.zeros_like(value[0])
        for t in reversed(range(len(batch))):
            carry = (
                reward[t]
                + gae.gamma * live[t] * next_value[t]
                - value[t]
                + gae.gamma * gae.gae_lambda * going_on[t] * carry
            )
            advantage[t] = carry
        torch.testing.assert_close(batch["advantage"].double(), advantage, rtol=1e-5, atol=1e-5)


# Torch envs whose terminations of even envs reach their time limit too, straight to the collector and through each
# adapter; where each takes the next_value of an episode end from (its final observation, or the row's own value);
# whether its time-outs end like terminations.
BOTH_FLAGS = [
    pytest.param(lambda: IsaacLabStyle(N, both=True), "final", False, id="torch-vector-env"),
    pytest.param(lambda: FromIsaacLab(IsaacLabEnv(N)), "final", False, id="FromIsaacLab"),
    pytest.param(
        lambda: FromRslRl(RslRlCartPole(N, final_obs=True, declares=True, both=True)), "final", False, id="FromRslRl"
    ),
    pytest.param(
        lambda: FromRslRl(RslRlCartPole(N, both=True), bootstrap="last_obs"), "own", False, id="FromRslRl-last_obs"
    ),
    pytest.param(lambda: FromRslRl(RslRlCartPole(N, both=True), bootstrap="none"), "own", True, id="FromRslRl-none"),
    pytest.param(
        lambda: FromRslRl(RslRlCartPole(N, layout="1.x", both=True, beneath="manager"), bootstrap="last_obs"),
        "own",
        False,
        id="FromRslRl-1.x",
    ),
]


@pytest.mark.parametrize(("make", "next_value_from", "time_outs_terminate"), BOTH_FLAGS)
def test_steps_that_terminate_at_the_time_limit_keep_both_flags_and_do_not_bootstrap(
    make, next_value_from, time_outs_terminate
):
    """terminated and truncated, as the framework gives them; next_value as for any episode end, and GAE takes the
    row as a termination."""
    envs, policy, gae = make(), GroupPolicy(), GAE(gamma=0.9, gae_lambda=0.8)
    env = getattr(envs, "env", envs)  # the torch env beneath the adapter
    batches = collect(envs, policy, seed=None, gae=gae)
    batch = torch.cat(batches)
    both = torch.stack(env.both_flags[: len(batch)])
    final_values, time_outs = _true_final_values(policy, env, len(batch))  # the time-outs that did not terminate
    assert both.any() and time_outs.any()
    assert torch.equal(batch["truncated"], time_outs | both)
    terminated = batch["done"] if time_outs_terminate else batch["done"] & ~time_outs
    assert torch.equal(batch["terminated"], terminated) and batch["terminated"][both].all()
    expected = final_values if next_value_from == "final" else batch["value"]
    done = batch["done"]
    torch.testing.assert_close(batch["next_value"][done], expected[done])
    _check_advantages_without_bootstrap_at_terminations(batches, gae)


def test_rsl_rl_style_time_outs_that_may_have_terminated_are_marked_where_nothing_beneath_tells():
    """Without an env beneath to ask, a time-out bootstrapped from extras["final_obs"] is marked 3, never exact."""
    env, policy = RslRlCartPole(N, final_obs=True, declares=True, both=True, beneath=None), GroupPolicy()
    keys = BatchKeys(info_keys=("bootstrap",))
    batch = torch.cat(collect(FromRslRl(env), policy, seed=None, keys=keys))
    both = torch.stack(env.both_flags[: len(batch)])
    _, time_outs = _true_final_values(policy, env, len(batch))
    assert both.any() and batch["truncated"][both].all()  # the approximation, as the env gives it
    assert torch.equal(batch["truncated"], time_outs | both)
    marks = batch["info", "bootstrap"]
    assert (marks[batch["truncated"]] == 3).all() and not marks[~batch["truncated"]].any()


def test_rsl_rl_style_envs_that_promise_final_obs_and_give_none_raise():
    message = "Collector: the env runs in SAME_STEP autoreset mode but its step infos had no final observation"
    for envs in (FromRslRl(RslRlCartPole(N), bootstrap="final_obs"), FromRslRl(RslRlCartPole(N, declares=True))):
        with pytest.raises(KeyError, match=re.escape(message)):
            collect(envs, GroupPolicy(), seed=None)


def test_rsl_rl_style_envs_need_a_bootstrap_choice_and_their_own_seed():
    message = "FromRslRl: bootstrap=None, and the env does not say that it gives final observations"
    with pytest.raises(ValueError, match=re.escape(message)):
        FromRslRl(RslRlCartPole(2))
    with pytest.raises(ValueError, match=re.escape("FromRslRl: bootstrap='exact', and the env does not say")):
        FromRslRl(RslRlCartPole(2), bootstrap="exact")
    with pytest.raises(ValueError, match=re.escape("FromRslRl.reset: seed=5, but an rsl_rl-style env is seeded")):
        collect(FromRslRl(RslRlCartPole(N), bootstrap="none"), GroupPolicy(), seed=5)


class NoDevice(RslRlCartPole):
    """An rsl_rl-style env without ``device``, as MuJoCo Playground's RSLRLBraxWrapper is on a CPU."""

    def __init__(self, num_envs: int, **kwargs: Any) -> None:
        super().__init__(num_envs, **kwargs)
        del self.device


def test_rsl_rl_style_envs_without_a_device_step_on_the_device_of_their_observations():
    envs = FromRslRl(NoDevice(N), bootstrap="last_obs")
    assert envs.device == torch.device("cpu")
    got = collect(envs, GroupPolicy(), seed=None)
    expected = collect(FromRslRl(RslRlCartPole(N), bootstrap="last_obs"), GroupPolicy(), seed=None)
    assert_same_batches(got, expected, ("action", "reward", "done", "mask", "value", "next_value"))
    for g, e in zip(got, expected):
        assert torch.equal(g["obs", "policy"], e["obs", "policy"])


def test_rsl_rl_style_envs_without_a_device_nor_tensors_to_take_it_from_are_refused():
    class NumpyObservations(NoDevice):
        def get_observations(self) -> Any:
            return {"policy": self.obs.numpy()}

    message = (
        "FromRslRl: the env NumpyObservations has no attribute `device`, and its get_observations() gives "
        "observations of types ['ndarray'], not torch tensors on one device to take it from; set env.device to "
        "the torch device of its tensors (e.g. env.device = 'cpu')"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        FromRslRl(NumpyObservations(N), bootstrap="last_obs")


def test_rsl_rl_style_final_obs_in_another_structure_is_named():
    class PolicyOnly(RslRlCartPole):
        def step(self, actions: torch.Tensor) -> tuple:
            obs, reward, dones, extras = super().step(actions)
            extras["final_obs"] = extras["final_obs"]["policy"]
            return obs, reward, dones, extras

    message = "FromRslRl.step: extras['final_obs'] holds Tensor, but the observation is the groups ['critic', 'policy']"
    with pytest.raises(ValueError, match=re.escape(message)):
        collect(FromRslRl(PolicyOnly(N, final_obs=True), bootstrap="final_obs"), GroupPolicy(), seed=None)


class IsaacLabStyle(VectorEnv):
    """CartPole stepped as Isaac Lab's own env: groups, same-step resets, extras["final_obs"] as a dict of groups."""

    def __init__(self, num_envs: int, *, both: bool = False) -> None:
        self.envs = make_cartpole(num_envs, AutoresetMode.SAME_STEP)
        self.num_envs, self.device, self.both = num_envs, self.envs.device, both
        self.metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}
        box = self.envs.single_observation_space
        self.single_observation_space = gym.spaces.Dict({"policy": box, "critic": box})
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.single_action_space, self.action_space = self.envs.single_action_space, self.envs.action_space
        self.finals: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.both_flags: list[torch.Tensor] = []

    def reset(self, *, seed: Any = None, options: dict | None = None) -> tuple:
        obs, _ = self.envs.reset(seed=seed, options=options)
        return {"policy": obs, "critic": 2 * obs}, {}

    def step(self, actions: torch.Tensor) -> tuple:
        obs, reward, terminated, time_outs, infos = self.envs.step((actions[:, 0] > 0).long())
        final = infos["final_obs"]
        self.finals.append((final.clone(), time_outs & ~terminated))
        if self.both:  # the terminations of even envs reach their time limit too
            time_outs = time_outs | (terminated & (torch.arange(self.num_envs) % 2 == 0))
        self.both_flags.append(terminated & time_outs)
        extras = {"final_obs": {"policy": final, "critic": 2 * final}, "log": {}}
        return {"policy": obs, "critic": 2 * obs}, reward, terminated, time_outs, extras


def test_gymnasium_style_isaac_lab_envs_bootstrap_time_outs_from_their_final_obs():
    env, policy = IsaacLabStyle(N), GroupPolicy()
    batch = torch.cat(collect(env, policy))
    expected, time_outs = _true_final_values(policy, env, len(batch))
    assert time_outs.any() and torch.equal(batch["truncated"] & ~batch["terminated"], time_outs)
    torch.testing.assert_close(batch["next_value"][time_outs], expected[time_outs])


class IsaacLabEnv(gym.Env):
    """CartPole as Isaac Lab's own DirectRLEnv presents itself: a batched gymnasium.Env of torch tensors.

    ``num_envs``, ``device``, ``cfg.compute_final_obs``, ``single_observation_space`` a Dict of groups; ``step``
    returns Isaac Lab's own flag buffers (written in place at the next step), and ``extras["final_obs"]`` whose rows
    of envs that did not end are an older step's, as Isaac Lab's persistent extras are. The terminations of even
    envs reach their time limit too: both flags set.
    """

    def __init__(self, num_envs: int, *, compute_final_obs: bool = True) -> None:
        self.envs = make_cartpole(num_envs, AutoresetMode.SAME_STEP)
        self.num_envs, self.device = num_envs, str(self.envs.device)
        self.cfg = types.SimpleNamespace(compute_final_obs=compute_final_obs)
        box = self.envs.single_observation_space
        self.single_observation_space = gym.spaces.Dict({"policy": box, "critic": box})
        self.single_action_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.reset_terminated = torch.zeros(num_envs, dtype=torch.bool)
        self.reset_time_outs = torch.zeros(num_envs, dtype=torch.bool)
        self.extras: dict[str, Any] = {"log": {}}
        self.finals: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.both_flags: list[torch.Tensor] = []
        self.flags_log: list[tuple[torch.Tensor, torch.Tensor]] = []

    def groups(self, obs: torch.Tensor) -> dict:
        return {"policy": obs, "critic": 2 * obs}

    def reset(self, *, seed: Any = None, options: dict | None = None) -> tuple:
        obs, _ = self.envs.reset(seed=seed, options=options)
        return self.groups(obs), self.extras

    def step(self, actions: torch.Tensor) -> tuple:
        obs, reward, terminated, truncated, infos = self.envs.step((actions[:, 0] > 0).long())
        final = infos["final_obs"]
        self.finals.append((final.clone(), truncated & ~terminated))
        truncated = truncated | (terminated & (torch.arange(self.num_envs) % 2 == 0))
        self.both_flags.append(terminated & truncated)
        self.flags_log.append((terminated.clone(), truncated.clone()))  # what the adapter returns
        self.reset_terminated[:], self.reset_time_outs[:] = terminated, truncated
        if self.cfg.compute_final_obs:
            groups, previous = self.groups(final.clone()), self.extras.get("final_obs")
            if previous is not None:  # envs that did not end keep an older step's rows, as in Isaac Lab's extras
                ended = (terminated | truncated)[:, None]
                groups = {key: torch.where(ended, value, previous[key]) for key, value in groups.items()}
            self.extras["final_obs"] = groups
        return self.groups(obs), reward, self.reset_terminated, self.reset_time_outs, self.extras


@pytest.mark.parametrize(
    "given",
    [
        pytest.param(lambda env: gym.wrappers.OrderEnforcing(env), id="gym.make"),
        pytest.param(lambda env: env, id="unwrapped"),
        pytest.param(FromIsaacLab, id="FromIsaacLab"),
    ],
)
def test_isaac_lab_own_envs_are_vector_envs_whose_time_outs_bootstrap_from_their_final_obs(given):
    """As they are: SAME_STEP, groups as a Dict, both flags kept, time-outs from extras["final_obs"]."""
    env, policy = IsaacLabEnv(N), GroupPolicy()
    options = dict(num_steps=T, device="cpu", seed=5, timeout=TIMEOUT, total_timesteps=4 * T * N)
    with Collector(given(env), policy, keys=BatchKeys(next_obs=True), **options) as collector:
        assert isinstance(collector.envs, FromIsaacLab) and collector.autoreset_mode == AutoresetMode.SAME_STEP
        batch = torch.cat(list(collector))
    assert isinstance(batch["obs"], TensorDict) and set(batch["obs"].keys()) == {"policy", "critic"}
    expected, time_outs = _true_final_values(policy, env, len(batch))
    both = torch.stack(env.both_flags[: len(batch)])
    assert time_outs.any() and both.any()
    assert torch.equal(batch["truncated"], time_outs | both)
    assert torch.equal(batch["terminated"], batch["done"] & ~time_outs) and batch["terminated"][both].all()
    torch.testing.assert_close(batch["next_value"][time_outs], expected[time_outs])
    finals = torch.stack([final for final, _ in env.finals[: len(batch)]])
    done = batch["done"]
    assert torch.equal(batch["next_obs", "policy"][done], finals[done])
    assert torch.equal(batch["next_obs", "critic"][done], 2 * finals[done])
    going_on = ~done[:-1]
    assert torch.equal(batch["next_obs", "policy"][:-1][going_on], batch["obs", "policy"][1:][going_on])


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: FromIsaacLab(IsaacLabEnv(N)), id="FromIsaacLab"),
        pytest.param(lambda: FromRslRl(RslRlCartPole(N, final_obs=True, declares=True, both=True)), id="FromRslRl"),
    ],
)
def test_isaac_lab_adapters_make_no_host_sync_per_step(make, monkeypatch):
    """Both flags and the env beneath read with dense ops: a fixed number of reads per batch, whatever its steps."""
    counter = SyncCounter(monkeypatch)
    counts = {}
    for steps in (8, 16):
        with Collector(make(), GroupPolicy(), num_steps=steps, device="cpu", backend="thread") as collector:
            batches = iter(collector)
            next(batches)  # the first batch learns the policy's outputs
            counts[steps] = [counter.count(batches) for _ in range(3)]
    assert counts[8] == counts[16] == [{"nonzero": 1}] * 3, counts  # the batch end's gather of final observations


def test_isaac_lab_own_flags_returned_by_a_step_stay_as_they_were_after_the_next():
    """Isaac Lab writes its flag buffers in place at every step: FromIsaacLab returns copies."""
    envs = FromIsaacLab(IsaacLabEnv(N))
    envs.reset(seed=0)
    held = [envs.step(torch.ones(N, 1))[2:4] for _ in range(2 * MAX_STEPS)]
    assert any(bool(terminated.any()) for terminated, _ in held)
    for (terminated, truncated), (expected_terminated, expected_truncated) in zip(held, envs.env.flags_log):
        assert torch.equal(terminated, expected_terminated) and torch.equal(truncated, expected_truncated)


def test_isaac_lab_own_envs_are_stepped_by_one_collector_at_a_time():
    env = gym.wrappers.OrderEnforcing(IsaacLabEnv(N))
    with Collector(env, GroupPolicy(), num_steps=T, device="cpu"):
        with pytest.raises(ValueError, match=re.escape("Collector: envs is already driven by another open")):
            Collector(env.unwrapped, GroupPolicy(), num_steps=T, device="cpu")


def test_isaac_lab_own_envs_built_by_a_recipe_are_vector_envs_too():
    got = collect(lambda num_envs: IsaacLabEnv(num_envs), GroupPolicy(), backend="thread")
    expected = collect(FromIsaacLab(IsaacLabEnv(N)), GroupPolicy())
    assert_same_batches(got, expected, ("action", "reward", "terminated", "truncated", "value", "next_value"))


def test_isaac_lab_own_envs_without_compute_final_obs_name_it_and_the_ways_forward():
    message = (
        "FromIsaacLab: Isaac Lab's IsaacLabEnv has cfg.compute_final_obs=False, so its step does not keep the "
        "observation before its same-step reset (extras['final_obs']) and a time-out has nothing to bootstrap from; "
        "set env_cfg.compute_final_obs = True before gym.make(task, cfg=env_cfg) for exact bootstraps, or step it "
        "through Isaac Lab's RslRlVecEnvWrapper and torch_rollout.envs.FromRslRl(wrapper, bootstrap='last_obs')"
    )
    env = gym.wrappers.OrderEnforcing(IsaacLabEnv(N, compute_final_obs=False))
    with pytest.raises(ValueError, match=re.escape(message)):
        Collector(env, GroupPolicy(), num_steps=T, device="cpu")


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.value)
def test_compiled_acting_gives_the_eager_batches(mode):
    """compile_policy on this path: the forward and the batch end's bootstrap calls (padded to num_envs) compile."""
    expected = collect(make_cartpole(N, mode), LinearPolicy(), backend="thread")
    got = collect(make_cartpole(N, mode), LinearPolicy(), backend="thread", compile_policy={"backend": "aot_eager"})
    assert_same_batches(got, expected)


class Float64Obs(VectorWrapper):
    """Observations as float64 tensors, of a float64 Box: stored, and given to the policy, as float32."""

    def __init__(self, envs: VectorEnv) -> None:
        super().__init__(envs)
        space = envs.single_observation_space
        self.single_observation_space = gym.spaces.Box(space.low, space.high, space.shape, np.float64)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, envs.num_envs)

    def reset(self, **kwargs: Any) -> tuple:
        obs, infos = self.env.reset(**kwargs)
        return obs.double(), infos

    def step(self, actions: Any) -> tuple:
        obs, *rest = self.env.step(actions)
        return (obs.double(), *rest)


def test_float64_observations_reach_the_policy_as_stored_float32():
    expected = collect(make_cartpole(N), LinearPolicy(), backend="thread")
    got = collect(Float64Obs(make_cartpole(N)), LinearPolicy(), backend="thread")  # float32 weights
    assert got[0]["obs"].dtype == torch.float32
    assert_same_batches(got, expected)


def test_gymnasiums_numpy_to_torch_wrapper_gives_the_numpy_batches():
    """A NumPy vector env seen through gymnasium's NumpyToTorch is collected as torch tensors, row for row the same.

    NEXT_STEP only: in SAME_STEP mode gymnasium's wrapper itself fails on the object array of final
    observations, and in DISABLED mode SyncVectorEnv refuses the all-False reset_mask of a step where no env
    ended, which the collector sends rather than read the mask back from the device.
    """
    pytest.importorskip("array_api_compat")  # what gymnasium's array conversions need
    from gymnasium.wrappers.vector import NumpyToTorch

    def numpy_envs() -> VectorEnv:
        return gym.make_vec("CartPole-v1", N, vectorization_mode="sync")

    expected = collect(numpy_envs(), LinearPolicy(), backend="thread")
    got = collect(NumpyToTorch(numpy_envs(), device="cpu"), LinearPolicy(), backend="thread")
    assert_same_batches(got, expected, keys=(*KEYS, "policy_version"))
    assert torch.cat(got)["done"].any()
