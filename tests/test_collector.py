"""Collector batches compared row by row with what the envs really did."""

from __future__ import annotations

import threading
import time
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from test_process import deterministic_cartpole_policy
from torch import nn

from torch_rollout import GAE, Collector

from counting_env import CountingPolicy, make_counting_envs, value_fn
from placements import PLACEMENTS, envs_for

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
MODE_IDS = ["next_step", "same_step", "disabled"]
GAMMA, LAMBDA = 0.9, 0.8
TIMEOUT = 60.0  # hang guard for next(); never reached when things work


def collect(envs, policy, *, num_steps, num_batches, prefetch, **kwargs):
    total = num_steps * envs.num_envs * num_batches
    with Collector(
        envs,
        policy,
        num_steps=num_steps,
        total_timesteps=total,
        prefetch=prefetch,
        device="cpu",
        gae=GAE(GAMMA, LAMBDA),
        seed=0,
        **kwargs,
    ) as collector:
        batches = list(collector)
    assert len(batches) == num_batches
    return batches


def reference_advantages(log_rows):
    """GAE over consecutive real transitions of one env within one batch, in float64."""
    advantage = np.zeros(len(log_rows))
    last = 0.0
    for j in reversed(range(len(log_rows))):
        obs, _, reward, next_obs, terminated, truncated = log_rows[j]
        v = value_fn(obs).item()
        next_v = value_fn(next_obs).item()
        delta = reward + GAMMA * (1 - terminated) * next_v - v
        last = delta + GAMMA * LAMBDA * (1 - (terminated or truncated)) * last
        advantage[j] = last
    return advantage


@pytest.mark.parametrize("prefetch", [0, 1], ids=lambda p: f"prefetch{p}")
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_batches_hold_every_real_transition_once_in_order(mode, prefetch):
    envs = make_counting_envs(3, mode)
    batches = collect(envs, CountingPolicy(), num_steps=5, num_batches=9, prefetch=prefetch)
    for i, env in enumerate(envs.envs):
        position = 0
        for batch in batches:
            rows = batch[:, i]
            real = rows[rows["mask"]]
            log_rows = env.log[position : position + real.shape[0]]
            position += real.shape[0]
            assert len(log_rows) == real.shape[0]
            obs, action, reward, next_obs, terminated, truncated = (np.array(c) for c in zip(*log_rows))
            np.testing.assert_array_equal(real["obs"].numpy(), obs.astype(np.float32))
            np.testing.assert_array_equal(real["action"].numpy(), action)
            np.testing.assert_array_equal(real["reward"].numpy(), reward.astype(np.float32))
            np.testing.assert_array_equal(real["terminated"].numpy(), terminated)
            np.testing.assert_array_equal(real["truncated"].numpy(), truncated)
            np.testing.assert_array_equal(real["done"].numpy(), terminated | truncated)
            # V of the true next state: of the final observation at episode ends.
            np.testing.assert_allclose(real["next_value"].numpy(), value_fn(next_obs).numpy(), rtol=1e-6)
            np.testing.assert_allclose(real["advantage"].numpy(), reference_advantages(log_rows), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(real["return"].numpy(), (real["advantage"] + real["value"]).numpy())
        # None missing: the env did nothing the batches don't show.
        assert position == len(env.log)
    envs.close()


@pytest.mark.parametrize("prefetch", [0, 1], ids=lambda p: f"prefetch{p}")
def test_next_step_reset_rows_are_masked(prefetch):
    envs = make_counting_envs(2, AutoresetMode.NEXT_STEP)
    batches = collect(envs, CountingPolicy(), num_steps=4, num_batches=10, prefetch=prefetch)
    full = torch.cat(batches)  # [40, 2]
    done = full["done"]
    # A row is a reset row exactly when the row before it ended an episode (across batch boundaries too).
    expected_fake = torch.zeros_like(done)
    expected_fake[1:] = done[:-1]
    torch.testing.assert_close(~full["mask"], expected_fake)
    fake = ~full["mask"]
    assert fake.any()
    assert (full["advantage"][fake] == 0).all()
    assert (full["reward"][fake] == 0).all() and not full["done"][fake].any()
    # The reset row's obs is the final observation of the episode before.
    assert (full["obs"][fake][:, 2] > 0).all()
    envs.close()


def test_same_trajectory_same_transitions_and_advantages_in_every_mode():
    """Deterministic actions: every mode sees the same trajectory. An episode that both starts
    and ends inside one batch has advantages independent of where batches are cut."""
    per_mode = {}
    for mode in MODES:
        envs = make_counting_envs(3, mode)
        (batch,) = collect(envs, CountingPolicy(deterministic=True), num_steps=40, num_batches=1, prefetch=1)
        per_mode[mode] = batch
        envs.close()
    keys = ["obs", "action", "reward", "terminated", "truncated", "next_value", "value"]
    for i in range(3):
        streams = {}
        for mode, batch in per_mode.items():
            rows = batch[:, i]
            real = rows[rows["mask"]]
            streams[mode] = real
        n = min(s.shape[0] for s in streams.values())
        reference = streams[AutoresetMode.NEXT_STEP]
        # Complete episodes within the NEXT_STEP batch (the shortest one).
        done_idx = torch.nonzero(reference["done"][:n]).flatten()
        complete = int(done_idx[-1]) + 1
        for mode, real in streams.items():
            for key in keys:
                torch.testing.assert_close(real[key][:n], reference[key][:n], msg=f"{key} differs in {mode}")
            torch.testing.assert_close(real["advantage"][:complete], reference["advantage"][:complete])


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_truncation_bootstraps_from_final_observation(mode):
    envs = make_counting_envs(3, mode)
    batches = collect(envs, CountingPolicy(), num_steps=7, num_batches=4, prefetch=1)
    full = torch.cat(batches)
    truncated = full["truncated"]
    assert truncated.any() and full["terminated"].any()
    obs = full["obs"][truncated]
    # Final observation: same episode, one step further, last action = the action taken.
    final_obs = obs.clone()
    final_obs[:, 2] += 1
    final_obs[:, 3] = full["action"][truncated].float()
    torch.testing.assert_close(full["next_value"][truncated], value_fn(final_obs).float())
    # ... and the advantage at a truncation is the one-step TD error (the episode ends there).
    delta = full["reward"] + GAMMA * full["next_value"] - full["value"]
    torch.testing.assert_close(full["advantage"][truncated], delta[truncated])
    envs.close()


def test_batch_boundary_bootstraps_from_next_batch_first_observation():
    envs = make_counting_envs(2, AutoresetMode.SAME_STEP)
    first, second = collect(envs, CountingPolicy(), num_steps=5, num_batches=2, prefetch=0)
    not_done = ~first["done"][-1]
    torch.testing.assert_close(first["next_value"][-1][not_done], second["value"][0][not_done])
    torch.testing.assert_close(first["next_value"][:-1][~first["done"][:-1]], first["value"][1:][~first["done"][:-1]])
    envs.close()


def test_batch_contract_keys_dtypes_and_episode_stats():
    envs = make_counting_envs(3, AutoresetMode.NEXT_STEP)
    batches = collect(envs, CountingPolicy(), num_steps=6, num_batches=3, prefetch=1)
    batch = batches[0]
    assert batch.batch_size == torch.Size([6, 3])
    assert batch["obs"].dtype == torch.float32  # float64 env obs
    assert batch["reward"].dtype == torch.float32
    for key in ("terminated", "truncated", "done", "mask"):
        assert batch[key].dtype == torch.bool
    assert batch["policy_version"].dtype == torch.int64
    expected = {
        "obs",
        "action",
        "value",
        "log_prob",
        "reward",
        "terminated",
        "truncated",
        "done",
        "mask",
        "next_value",
        "advantage",
        "return",
        "episode_return",
        "episode_length",
        "policy_version",
    }
    assert set(batch.keys()) == expected
    # Episode totals at episode ends: length from the env's rule, return = sum of 10*t + a.
    full = torch.cat(batches)
    ends = full["done"] & full["mask"]
    for t, i in ends.nonzero().tolist():
        env = envs.envs[i]
        episode = int(full["obs"][t, i, 1])
        assert full["episode_length"][t, i].item() == env.length(episode)
        steps = [row for row in env.log if row[0][0] == i and row[0][1] == episode]
        assert full["episode_return"][t, i].item() == pytest.approx(sum(row[2] for row in steps))
    envs.close()


def test_env_id_with_total_timesteps_gives_ceil_batches():
    with Collector(
        "TorchRolloutCounting-v0",
        CountingPolicy(),
        num_envs=2,
        num_steps=10,
        total_timesteps=45,
        device="cpu",
        backend="thread",
    ) as collector:
        assert isinstance(collector.envs, SyncVectorEnv)
        assert len(collector) == 3
        batches = list(collector)
    assert len(batches) == 3
    assert collector.closed and collector.envs.closed  # created by the collector: closed with it


class CountingPolicyForCartPole(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, obs):
        out = self.linear(obs)
        logits, value = out[:, :2], out[:, 2]
        dist = torch.distributions.Categorical(logits=logits)
        action = dist.sample()
        return {"action": action, "log_prob": dist.log_prob(action), "value": value, "logits": logits}


def test_seeded_lockstep_runs_are_identical():
    def run():
        torch.manual_seed(123)
        policy = CountingPolicyForCartPole()
        with Collector(
            "CartPole-v1",
            policy,
            num_envs=4,
            num_steps=32,
            total_timesteps=4 * 32 * 4,
            prefetch=0,
            seed=7,
            device="cpu",
        ) as collector:
            return torch.cat(list(collector))

    first, second = run(), run()
    assert "logits" in first.keys()
    assert (first == second).all()
    assert first["done"].any()


@pytest.mark.parametrize("autoreset_mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_the_policy_acts_and_bootstraps_on_observations_at_one_place_in_memory(autoreset_mode):
    """Every call's observations start on a 64-byte boundary (4 envs of 4 float32: each row fills one), the
    bootstrap on the observations the next batch starts with too: some CPU kernels' last bits depend on where
    an input starts, and an env's own array lies wherever its allocator put it, so that seeded runs differed."""

    class Where(CountingPolicyForCartPole):
        def __init__(self) -> None:
            super().__init__()
            self.offsets: list[int] = []

        def forward(self, obs):
            self.offsets.append(obs.data_ptr() % 64)
            return super().forward(obs)

    policy = Where()
    envs = gym.make_vec("CartPole-v1", 4, vectorization_mode="sync", vector_kwargs={"autoreset_mode": autoreset_mode})
    with Collector(envs, policy, num_steps=8, total_timesteps=4 * 8 * 6, prefetch=0, seed=3, device="cpu") as collector:
        for _ in collector:
            pass
    assert len(policy.offsets) > 6 * 8  # the steps' calls and the bootstraps
    assert set(policy.offsets) == {0}


def test_policy_without_value_gives_no_advantages():
    class ActOnly(nn.Module):
        def forward(self, obs):
            return {"action": torch.zeros(obs.shape[0], dtype=torch.long)}

    envs = make_counting_envs(2)
    (batch,) = collect(envs, ActOnly(), num_steps=4, num_batches=1, prefetch=0)
    assert "advantage" not in batch.keys() and "next_value" not in batch.keys()
    assert batch["action"].shape == (4, 2)
    envs.close()


def test_tensordict_module_policy():
    net = nn.Linear(4, 1)
    module = TensorDictModule(
        lambda obs: (torch.zeros(obs.shape[0], dtype=torch.long), net(obs)),
        in_keys=["obs"],
        out_keys=["action", "value"],
    )
    envs = make_counting_envs(2)
    (batch,) = collect(envs, module, num_steps=3, num_batches=1, prefetch=0)
    assert batch["value"].shape == (3, 2)  # [N, 1] values are squeezed
    assert (batch["action"] == 0).all()
    envs.close()


# -- the same batches on every placement ------------------------------------------------------


@pytest.mark.ray(prefetch=(1,))
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("prefetch", [0, 1, 2], ids=lambda p: f"prefetch{p}")
def test_every_placement_gives_the_batches_of_the_lockstep_thread(prefetch, placement):
    """Env ``j`` is seeded ``seed + j`` wherever it runs: a deterministic policy sees the same episodes."""
    recipe = partial(gym.make_vec, "CartPole-v1", vectorization_mode="sync")

    def run(placement: dict, prefetch: int) -> TensorDict:
        envs, extra = envs_for(placement, recipe, 6)
        with Collector(
            envs,
            deterministic_cartpole_policy(),
            num_steps=40,
            total_timesteps=6 * 40 * 3,
            seed=11,
            device="cpu",
            prefetch=prefetch,
            timeout=TIMEOUT,
            **placement,
            **extra,
        ) as collector:
            batches = torch.cat(list(collector))
        if not extra:
            envs.close()
        return batches

    reference, batches = run({"backend": "thread"}, 0), run(placement, prefetch)
    assert reference["done"].any()
    for name in ("obs", "action", "reward", "terminated", "truncated", "next_value", "advantage", "return", "mask"):
        assert torch.equal(batches[name], reference[name]), name


# -- weights and versions ----------------------------------------------------------------------


class VersionProbe(nn.Module):
    """Outputs both of its weights per env: a row with a != b mixed two weight versions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.0))
        self.b = nn.Parameter(torch.tensor(0.0))

    def forward(self, obs):
        n = obs.shape[0]
        time.sleep(0.001)  # widen the window between reading a and b
        a = self.a.expand(n).clone()
        time.sleep(0.001)
        return {"action": torch.zeros(n, dtype=torch.long), "a": a, "b": self.b.expand(n).clone()}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("prefetch", [0, 1, 2], ids=lambda p: f"prefetch{p}")
def test_no_torn_weights_and_bounded_lag_while_trainer_updates(prefetch, placement):
    policy = VersionProbe()
    envs, extra = envs_for(placement, make_counting_envs, 2)
    weights_at_version = {}
    last_seen = torch.full((2,), -1)  # per env: worker processes refresh independently of each other
    with Collector(
        envs, policy, num_steps=8, total_timesteps=8 * 2 * 12, prefetch=prefetch, device="cpu", **placement, **extra
    ) as collector:
        weights_at_version[0] = 0.0
        for batch in collector:
            weights_at_version[collector.policy_version] = policy.a.item()
            versions = batch["policy_version"]
            assert (versions[1:] >= versions[:-1]).all() and (versions[0] >= last_seen).all()
            last_seen = versions[-1]
            assert collector.policy_version - int(versions.min()) <= max(prefetch, 0) + (prefetch == 0)
            assert (batch["a"] == batch["b"]).all(), "a row saw two weight versions"
            for version, value in zip(versions.flatten().tolist(), batch["a"].flatten().tolist()):
                assert value == weights_at_version[version]
            # The trainer's update: in place, one parameter at a time, slowly.
            with torch.no_grad():
                policy.a.add_(1.0)
                time.sleep(0.01)
                policy.b.add_(1.0)
    if not extra:
        envs.close()


@pytest.mark.ray
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_update_policy_refreshes_mid_iteration(placement):
    policy = VersionProbe()
    envs, extra = envs_for(placement, make_counting_envs, 2)
    with Collector(envs, policy, num_steps=4, prefetch=1, device="cpu", **placement, **extra) as collector:
        it = iter(collector)
        next(it)
        version = collector.policy_version
        with torch.no_grad():
            policy.a.fill_(5.0)
            policy.b.fill_(5.0)
        collector.update_policy()
        assert collector.policy_version == version + 1
        rows = torch.cat([next(it) for _ in range(3)])
        newer = rows["policy_version"] > version
        assert newer.any()  # the refresh reached the acting copy ...
        assert (rows["a"][newer] == 5.0).all() and (rows["a"][~newer] == 0.0).all()  # ... and it alone
    if not extra:
        envs.close()


class ThreadsProbe(nn.Module):
    """Reports the intra-op thread count torch gives the thread that runs the policy."""

    def forward(self, obs):
        n = obs.shape[0]
        return {"action": torch.zeros(n, dtype=torch.long), "threads": torch.full((n,), torch.get_num_threads())}


@pytest.mark.ray
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_acting_policy_runs_on_one_intra_op_thread_and_the_trainer_keeps_its_own(placement):
    """Two OpenMP teams on one machine spin against each other: the collector takes one thread, nothing else."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(2, 2).sum()  # the trainer has run a torch op: its own thread team exists
        envs, extra = envs_for(placement, make_counting_envs, 2)
        with Collector(
            envs, ThreadsProbe(), num_steps=3, total_timesteps=2 * 3 * 2, device="cpu", prefetch=1, **placement, **extra
        ) as collector:
            threads = torch.cat([batch["threads"] for batch in collector])
        assert (threads == 1).all()
        assert torch.get_num_threads() == 2  # the trainer's thread
        later: list[int] = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later == [2]  # and the threads it starts later
        if not extra:
            envs.close()
    finally:
        torch.set_num_threads(previous)


# -- spaces ------------------------------------------------------------------------------------


class SpacesEnv(gym.Env):
    """Dict observations (uint8 image, Discrete, MultiBinary) and a configurable action space."""

    metadata: dict = {"render_modes": []}

    def __init__(self, action_space: gym.Space) -> None:
        self.observation_space = gym.spaces.Dict(
            {
                "image": gym.spaces.Box(0, 255, (3, 2, 2), np.uint8),
                "index": gym.spaces.Discrete(5),
                "bits": gym.spaces.MultiBinary(3),
                "levels": gym.spaces.MultiDiscrete([2, 4]),
            }
        )
        self.action_space = action_space
        self.received: list = []
        self.t = 0

    def _obs(self):
        return {
            "image": np.full((3, 2, 2), self.t % 256, dtype=np.uint8),
            "index": self.t % 5,
            "bits": np.array([1, 0, self.t % 2], dtype=np.int8),
            "levels": np.array([self.t % 2, self.t % 4]),
        }

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.received.append(np.array(action))
        self.t += 1
        return self._obs(), 1.0, False, self.t == 4, {}


class SpacesPolicy(nn.Module):
    def __init__(self, make_action) -> None:
        super().__init__()
        self.make_action = make_action

    def forward(self, obs: TensorDict):
        n = obs.shape[0]
        assert isinstance(obs, TensorDict)
        value = obs["image"].float().mean(dim=(1, 2, 3)) + obs["index"].float()
        return {"action": self.make_action(n), "value": value}


@pytest.mark.parametrize(
    "action_space, make_action",
    [
        (gym.spaces.Box(-1.0, 1.0, (2,), np.float32), lambda n: torch.full((n, 2), 3.0)),
        (gym.spaces.Discrete(4), lambda n: torch.full((n,), 3)),
        (gym.spaces.MultiDiscrete([3, 5]), lambda n: torch.tensor([[2, 4]] * n)),
        (gym.spaces.MultiBinary(4), lambda n: torch.ones(n, 4, dtype=torch.int8)),
    ],
    ids=["box", "discrete", "multidiscrete", "multibinary"],
)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_spaces(action_space, make_action, mode):
    envs = SyncVectorEnv([lambda: SpacesEnv(action_space) for _ in range(2)], autoreset_mode=mode)
    (batch,) = collect(envs, SpacesPolicy(make_action), num_steps=6, num_batches=1, prefetch=1)
    obs = batch["obs"]
    assert isinstance(obs, TensorDict) and obs.batch_size == torch.Size([6, 2])
    assert obs["image"].dtype == torch.uint8 and obs["image"].shape == (6, 2, 3, 2, 2)
    assert obs["index"].dtype == torch.int64 and obs["bits"].dtype == torch.int8
    assert obs["levels"].shape == (6, 2, 2)
    real = batch[batch["mask"]]
    assert (real["obs", "image"][:, 0, 0, 0].long() % 5 == real["obs", "index"]).all()
    received = np.stack(envs.envs[0].received)
    if isinstance(action_space, gym.spaces.Box):
        # The env gets clipped actions; the batch keeps what the policy returned.
        assert (received == 1.0).all() and (batch["action"] == 3.0).all()
    else:
        np.testing.assert_array_equal(received, np.broadcast_to(make_action(1)[0].numpy(), received.shape))
    # Final observations of truncated episodes are valued, in Dict spaces too: V = 4 (image t=4) + 4 (index).
    truncated = batch["truncated"]
    assert truncated.any()
    torch.testing.assert_close(batch["next_value"][truncated], torch.full((int(truncated.sum()),), 8.0))
    envs.close()


class DictObsPolicy(nn.Module):
    """Action 3, a value from the Dict observation, and an output in a dtype NumPy lacks (bfloat16)."""

    def forward(self, obs: TensorDict) -> dict[str, torch.Tensor]:
        n = obs.shape[0]
        value = obs["image"].float().mean(dim=(1, 2, 3)) + obs["index"].float()
        return {"action": torch.full((n,), 3), "value": value, "half": value.to(torch.bfloat16)}


def spaces_envs(num_envs: int) -> SyncVectorEnv:
    return SyncVectorEnv([partial(SpacesEnv, gym.spaces.Discrete(4)) for _ in range(num_envs)])


@pytest.mark.ray
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_dict_observations_and_any_dtype_travel_and_batches_are_writable_copies(placement):
    envs, extra = envs_for(placement, spaces_envs, 3)
    with Collector(
        envs,
        DictObsPolicy(),
        num_steps=6,
        total_timesteps=3 * 6 * 2,
        device="cpu",
        timeout=TIMEOUT,
        **placement,
        **extra,
    ) as collector:
        batches = list(collector)
    if not extra:
        envs.close()
    for batch in batches:
        obs = batch["obs"]
        assert isinstance(obs, TensorDict) and obs.batch_size == torch.Size([6, 3])
        assert obs["image"].dtype == torch.uint8 and obs["bits"].dtype == torch.int8
        real = batch[batch["mask"]]
        assert (real["obs", "image"][:, 0, 0, 0].long() % 5 == real["obs", "index"]).all()
        truncated = batch["truncated"]
        torch.testing.assert_close(batch["next_value"][truncated], torch.full((int(truncated.sum()),), 8.0))
        assert batch["half"].dtype == torch.bfloat16 and torch.equal(batch["half"], batch["value"].to(torch.bfloat16))
    assert not batches[0]["obs", "image"].is_shared()  # delivered batches are copies, not the worker's slots
    batches[0]["obs", "image"].add_(1)  # nor the object store's read-only memory
    batches[0]["reward"].mul_(2)


@pytest.mark.ray(prefetch=(1,), mode=(AutoresetMode.NEXT_STEP,))
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("prefetch", [0, 1], ids=lambda p: f"prefetch{p}")
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_cuda_batches_match_cpu(mode, prefetch, placement):
    results = {}
    for device in ("cpu", "cuda"):
        envs, extra = envs_for(placement, partial(make_counting_envs, mode=mode), 3)
        policy = CountingPolicy(deterministic=True).to(device)
        with Collector(
            envs,
            policy,
            num_steps=5,
            total_timesteps=5 * 3 * 4,
            prefetch=prefetch,
            device=device,
            gae=GAE(GAMMA, LAMBDA),
            **placement,
            **extra,
        ) as collector:
            results[device] = torch.cat(list(collector))
        if not extra:
            envs.close()
    assert results["cuda"].device.type == "cuda"
    assert results["cuda"]["advantage"].device.type == "cuda"
    for key in ("obs", "action", "reward", "mask", "done", "next_value"):
        torch.testing.assert_close(results["cuda"][key].cpu(), results["cpu"][key])
    torch.testing.assert_close(results["cuda"]["advantage"].cpu(), results["cpu"]["advantage"], rtol=1e-5, atol=1e-5)


def _pendulum_envs(num_envs: int, start_index: int = 0) -> SyncVectorEnv:
    return gym.make_vec("Pendulum-v1", num_envs=num_envs, vectorization_mode="sync")


class _PendulumPolicy(nn.Module):
    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": torch.zeros(obs.shape[0], 1)}


@pytest.mark.ray
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_spaces_are_known_right_after_construction(placement):
    """An agent is sized from the collector's spaces, before any batch and without an env of its own."""
    envs, extra = envs_for(placement, _pendulum_envs, 3)
    with Collector(envs, _PendulumPolicy(), num_steps=2, device="cpu", **placement, **extra) as collector:
        single = gym.make("Pendulum-v1")
        assert collector.single_observation_space == single.observation_space
        assert collector.single_action_space == single.action_space
        assert collector.observation_space.shape == (3, 3) and collector.action_space.shape == (3, 1)
        assert collector.observation_space.dtype == np.float32
        single.close()
        assert next(collector)["obs"].shape == (2, 3, 3)
    if placement["backend"] == "thread":
        envs.close()
