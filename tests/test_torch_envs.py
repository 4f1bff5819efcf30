"""torch_rollout.envs: gymnasium's trajectories, each autoreset mode, seeding, and steps free of host syncs."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.envs.classic_control.cartpole import CartPoleEnv
from gymnasium.envs.classic_control.pendulum import PendulumEnv
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from torch import Tensor

from torch_rollout.envs import CartPole, Pendulum
from torch_rollout.envs._base import TorchVectorEnv, mix64


@dataclass(frozen=True)
class Kind:
    """One env of the package and its gymnasium original."""

    cls: type[TorchVectorEnv]
    gym_cls: type[gym.Env]
    gym_id: str
    # Short enough that a few hundred steps of random actions reach the time limit, and (CartPole) terminate.
    episode_steps: int
    observe: Callable[[np.ndarray], np.ndarray]  # gymnasium's observation of a float64 state

    def actions(self, steps: int, num_envs: int, seed: int) -> Tensor:
        """Random actions ``[steps, num_envs, *action_shape]``: CartPole's pushes, Pendulum's torques."""
        generator = torch.Generator().manual_seed(seed)
        if self.cls is CartPole:
            return torch.randint(2, (steps, num_envs), generator=generator)
        # Multiples of 1/16: gymnasium computes with float32 torques, and these stay exact in its products
        # (a pendulum under random torques is chaotic, so a rounding apart would grow to 1e-3 in 200 steps).
        # Beyond [-2, 2] so that the clipping is at stake.
        return torch.randint(-40, 41, (steps, num_envs, 1), generator=generator).float() / 16


CARTPOLE = Kind(CartPole, CartPoleEnv, "CartPole-v1", 25, lambda state: state.astype(np.float32))
PENDULUM = Kind(
    Pendulum,
    PendulumEnv,
    "Pendulum-v1",
    70,
    lambda state: np.array([np.cos(state[0]), np.sin(state[0]), state[1]], dtype=np.float32),
)
KINDS = [pytest.param(CARTPOLE, id="CartPole"), pytest.param(PENDULUM, id="Pendulum")]
MODES = [pytest.param(mode, id=mode.value) for mode in AutoresetMode]
ENDED_KEYS = [pytest.param("final_obs", id="gymnasium-keys"), pytest.param("final_observation", id="ManiSkill3-keys")]


class KeyedStarts(gym.Wrapper):
    """A gymnasium env whose episode ``e`` after ``reset(seed=k)`` starts from the torch env's state for (k, e)."""

    def __init__(self, env: gym.Env, kind: Kind, twin: TorchVectorEnv) -> None:
        super().__init__(env)
        self.kind, self.twin = kind, twin
        self.key, self.episode = -1, -1

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        self.env.reset(seed=seed)
        if seed is not None:
            self.key, self.episode = seed, 0
        else:
            self.episode += 1
        state = self.twin.initial_states(torch.tensor([self.key]), torch.tensor([self.episode]))[0].numpy()
        self.env.unwrapped.state = state
        return self.kind.observe(state), {}


def gymnasium_twin(kind: Kind, envs: TorchVectorEnv) -> SyncVectorEnv:
    """Gymnasium's own env of ``kind`` in a ``SyncVectorEnv`` of the same mode, starting where ``envs`` starts."""

    def make() -> gym.Env:
        return gym.wrappers.TimeLimit(KeyedStarts(kind.gym_cls(), kind, envs), envs.max_episode_steps)

    return SyncVectorEnv([make] * envs.num_envs, autoreset_mode=envs.autoreset_mode)


def as_tensor(array: Any, like: Tensor) -> Tensor:
    """Gymnasium's result as a tensor of the dtype of ours (its rewards are float64)."""
    return torch.as_tensor(np.asarray(array), dtype=like.dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_trajectories_are_gymnasiums(kind: Kind, mode: AutoresetMode) -> None:
    envs = kind.cls(4, autoreset_mode=mode, max_episode_steps=kind.episode_steps)
    theirs = gymnasium_twin(kind, envs)
    obs, _ = envs.reset(seed=21)
    torch.testing.assert_close(obs, as_tensor(theirs.reset(seed=21)[0], obs))
    ends = {"terminated": 0, "truncated": 0}
    for action in kind.actions(300, 4, seed=1):
        ours = envs.step(action)
        their = theirs.step(action.numpy())
        for name, mine, other in zip(("obs", "reward", "terminated", "truncated"), ours[:4], their[:4]):
            torch.testing.assert_close(mine, as_tensor(other, mine), msg=lambda m, name=name: f"{name}: {m}")
        ends["terminated"] += int(ours[2].sum())
        ends["truncated"] += int(ours[3].sum())
        ended = (ours[2] | ours[3]).numpy()
        if mode is AutoresetMode.SAME_STEP:
            infos, their_infos = ours[4], their[4]
            torch.testing.assert_close(infos["_final_obs"], torch.as_tensor(their_infos.get("_final_obs", ended)))
            if ended.any():
                final = np.stack(their_infos["final_obs"][ended])
                torch.testing.assert_close(infos["final_obs"][torch.from_numpy(ended)], as_tensor(final, obs))
        if mode is AutoresetMode.DISABLED and ended.any():
            obs, _ = envs.reset(options={"reset_mask": torch.from_numpy(ended)})
            torch.testing.assert_close(obs, as_tensor(theirs.reset(options={"reset_mask": ended})[0], obs))
    assert ends["truncated"] > 0
    assert ends["terminated"] > 0 or kind is PENDULUM


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # 'T': both envs truncated at that step; NEXT_STEP's 4th step is the reset, DISABLED never resets.
        pytest.param(AutoresetMode.NEXT_STEP, "..T...T.", id="NextStep"),
        pytest.param(AutoresetMode.SAME_STEP, "..T..T..", id="SameStep"),
        pytest.param(AutoresetMode.DISABLED, "..TTTTTT", id="Disabled"),
    ],
)
def test_time_limit_truncates_at_max_episode_steps(mode: AutoresetMode, expected: str) -> None:
    envs = Pendulum(2, autoreset_mode=mode, max_episode_steps=3)
    envs.reset(seed=0)
    seen = ""
    for _ in expected:
        _, reward, terminated, truncated, _ = envs.step(torch.zeros(2, 1))
        assert not terminated.any()
        assert truncated[0] == truncated[1]
        seen += "T" if truncated[0] else "."
        assert bool((reward == 0).all()) == (mode is AutoresetMode.NEXT_STEP and len(seen) in (4, 8))
    assert seen == expected


def _push_right_until_row_0_falls(envs: CartPole, steps: int) -> tuple[list[tuple], Tensor]:
    """``steps`` steps of row 0 pushing right and row 1 alternating, after ``reset(seed=5)``."""
    envs.reset(seed=5)
    actions = torch.tensor([[1, t % 2] for t in range(steps)])
    return [envs.step(action) for action in actions], actions


def _reference_episode_end() -> tuple[int, list[tuple], Tensor, list[tuple]]:
    """The DISABLED run around row 0's first episode end: its step, steps up to it, the reset, one step after."""
    envs = CartPole(2, autoreset_mode=AutoresetMode.DISABLED)
    before, actions = _push_right_until_row_0_falls(envs, 30)
    end = next(t for t, out in enumerate(before) if out[2][0])  # 0-based index of the ending step
    assert not (before[end][2][1] or before[end][3][1]), "row 1 must still be going when row 0 falls"
    envs = CartPole(2, autoreset_mode=AutoresetMode.DISABLED)
    before, _ = _push_right_until_row_0_falls(envs, end + 1)
    reset, _ = envs.reset(options={"reset_mask": torch.tensor([True, False])})
    after = envs.step(actions[end + 1])
    return end, before, reset, [after]


def test_reset_mask_restarts_only_its_envs_in_disabled_mode() -> None:
    end, before, reset, _ = _reference_episode_end()
    torch.testing.assert_close(reset[1], before[end][0][1], rtol=0, atol=0)  # row 1 goes on
    start = CartPole(1).initial_states(torch.tensor([5]), torch.tensor([1]))[0].float()  # row 0's 2nd episode
    torch.testing.assert_close(reset[0], start, rtol=0, atol=0)


@pytest.mark.parametrize("as_mask", [pytest.param(torch.tensor, id="tensor"), pytest.param(np.array, id="numpy")])
def test_reset_mask_takes_a_tensor_or_a_numpy_array(as_mask: Callable[[list[bool]], Any]) -> None:
    envs = Pendulum(3, autoreset_mode=AutoresetMode.DISABLED)
    obs, _ = envs.reset(seed=1)
    envs.step(torch.ones(3, 1))
    moved = envs.step(torch.ones(3, 1))[0]
    again, _ = envs.reset(seed=1, options={"reset_mask": as_mask([False, True, False])})
    torch.testing.assert_close(again[[0, 2]], moved[[0, 2]], rtol=0, atol=0)
    torch.testing.assert_close(again[1], obs[1], rtol=0, atol=0)  # seeded: env 1 is keyed 1 + 1 again, episode 0


def test_next_step_mode_resets_the_step_after_an_end() -> None:
    end, before, reset, after = _reference_episode_end()
    envs = CartPole(2)
    outs, _ = _push_right_until_row_0_falls(envs, end + 2)
    for t in range(end + 1):  # up to the end, as without autoreset
        for mine, ref in zip(outs[t][:4], before[t][:4]):
            torch.testing.assert_close(mine, ref, rtol=0, atol=0)
    obs, reward, terminated, truncated, infos = outs[end + 1]
    torch.testing.assert_close(obs[0], reset[0], rtol=0, atol=0)  # row 0: its action ignored
    torch.testing.assert_close(obs[1], after[0][0][1], rtol=0, atol=0)
    assert reward.tolist() == [0.0, 1.0]
    assert terminated.tolist() == truncated.tolist() == [False, False]
    assert infos == {}


@pytest.mark.parametrize("key", ENDED_KEYS)
def test_same_step_mode_resets_at_the_end_and_keeps_the_final_obs(key: str) -> None:
    end, before, reset, after = _reference_episode_end()
    envs = CartPole(2, autoreset_mode=AutoresetMode.SAME_STEP, final_obs_key=key)
    outs, _ = _push_right_until_row_0_falls(envs, end + 2)
    obs, reward, terminated, truncated, infos = outs[end]
    assert set(infos) == {key, f"_{key}", "final_info", "_final_info"}
    assert infos[f"_{key}"].tolist() == infos["_final_info"].tolist() == [True, False]
    assert infos["final_info"] == {}
    torch.testing.assert_close(infos[key][0], before[end][0][0], rtol=0, atol=0)  # the obs that ended it
    torch.testing.assert_close(obs[0], reset[0], rtol=0, atol=0)
    torch.testing.assert_close(obs[1], before[end][0][1], rtol=0, atol=0)
    assert terminated.tolist() == [True, False] and reward.tolist() == [1.0, 1.0]
    for mine, ref in zip(outs[end + 1][:4], after[0][:4]):  # the step after: row 0 in its new episode
        torch.testing.assert_close(mine, ref, rtol=0, atol=0)
    for t in range(end):
        assert not outs[t][4][f"_{key}"].any()


def _run(envs: TorchVectorEnv, actions: Tensor, **reset: Any) -> list[Tensor]:
    """Every result of ``envs`` reset with ``reset`` and stepped with ``actions``, flattened."""
    out = list(envs.reset(**reset)[:1])
    for action in actions:
        out.extend(envs.step(action)[:4])
    return out


def _assert_same(a: list[Tensor], b: list[Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_episodes(kind: Kind) -> None:
    actions = kind.actions(200, 3, seed=2)
    first = _run(kind.cls(3, max_episode_steps=30), actions, seed=3)
    _assert_same(first, _run(kind.cls(3, max_episode_steps=30), actions, seed=3))
    envs = kind.cls(3, max_episode_steps=30)
    _run(envs, actions[:50], seed=99)
    _assert_same(first, _run(envs, actions, seed=3))  # a seeded reset starts the streams anew


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_an_env_has_the_same_episodes_however_the_envs_are_split(kind: Kind, mode: AutoresetMode) -> None:
    actions = kind.actions(200, 4, seed=3)  # envs 0 and 1 act on their own: 2 and 3 must not notice

    def rows(envs: TorchVectorEnv, acts: Tensor, **reset: Any) -> list[Tensor]:
        out = list(envs.reset(**reset)[:1])
        for action in acts:
            out.extend(envs.step(action)[:4])
            if mode is AutoresetMode.DISABLED:  # at every step, so that the two runs reset alike
                out.append(envs.reset(options={"reset_mask": out[-1] | out[-2]})[0])
        return [x[-2:] for x in out]

    split = dict(autoreset_mode=mode, max_episode_steps=30)
    whole = rows(kind.cls(4, **split), actions, seed=10)
    _assert_same(whole, rows(kind.cls(2, **split), actions[:, 2:], seed=12))
    _assert_same(whole, rows(kind.cls(2, **split), actions[:, 2:], seed=[12, 13]))


@pytest.mark.parametrize("kind", KINDS)
def test_different_seeds_start_different_episodes(kind: Kind) -> None:
    a, _ = kind.cls(3).reset(seed=0)
    b, _ = kind.cls(3).reset(seed=1)
    torch.testing.assert_close(a[1:], b[:2], rtol=0, atol=0)  # env j + 1 of seed 0 is env j of seed 1
    assert (a != b).all(dim=1).all(), "each env's start differs from the other seed's"
    assert len({tuple(row.tolist()) for row in a}) == 3


def test_reset_without_seed_draws_keys_from_torchs_generator_then_goes_on() -> None:
    torch.manual_seed(0)
    a, _ = CartPole(3).reset()
    torch.manual_seed(0)
    envs = CartPole(3)
    b, _ = envs.reset()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a != CartPole(3).reset()[0]).all()  # the generator moved on
    envs.reset(seed=4)
    nxt, _ = envs.reset()
    start = envs.initial_states(torch.tensor([4, 5, 6]), torch.tensor([1, 1, 1])).float()
    torch.testing.assert_close(nxt, start, rtol=0, atol=0)  # each env's 2nd episode


@pytest.mark.parametrize("kind", KINDS)
def test_initial_states_are_uniform_in_gymnasiums_bounds(kind: Kind) -> None:
    envs = kind.cls(1)
    keys = torch.arange(20_000).repeat_interleave(2)
    states = envs.initial_states(keys, torch.arange(2).repeat(20_000))  # 2 episodes of 20,000 keys
    high = torch.tensor([0.05] * 4 if kind is CARTPOLE else [np.pi, 1.0], dtype=torch.float64)
    assert ((states >= -high) & (states < high)).all()
    torch.testing.assert_close(states.mean(0), torch.zeros_like(high), rtol=0, atol=0.02 * float(high.max()))
    torch.testing.assert_close(states.std(0), high / 3**0.5, rtol=0.02, atol=0)  # std of U[-h, h): h / sqrt(3)


def test_mix64_is_splitmix64() -> None:
    def reference(z: int) -> int:
        z %= 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        z ^= z >> 31
        return z - 2**64 if z >= 2**63 else z

    # Words with the sign bit set are where an arithmetic shift would go wrong.
    words = [0, 1, 2**62 + 12345, 2**63 - 1, -1, -(2**63), -123456789012345]
    assert mix64(torch.tensor(words)).tolist() == [reference(w) for w in words]


def _record(envs: TorchVectorEnv, actions: Tensor) -> list[tuple]:
    """The results of stepping ``envs`` (reset beforehand) with ``actions``, resetting ended envs in DISABLED mode."""
    outs = []
    for action in actions:
        outs.append(envs.step(action))
        if envs.autoreset_mode is AutoresetMode.DISABLED:
            envs.reset(options={"reset_mask": outs[-1][2] | outs[-1][3]})
    return outs


_SYNCING = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__", "__array__")


@contextmanager
def no_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every tensor method that would wait for the device raises, and so does boolean-mask indexing."""

    def refuse(name: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"host synchronisation: {name} called in the step path")

        return refused

    getitem = torch.Tensor.__getitem__

    def dense_getitem(self: Tensor, index: Any) -> Any:
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, Tensor) and p.dtype == torch.bool for p in parts):
            raise AssertionError("host synchronisation: boolean-mask indexing in the step path")
        return getitem(self, index)

    with monkeypatch.context() as patch:
        for name in _SYNCING:
            patch.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
        patch.setattr(torch, "nonzero", refuse("torch.nonzero"))
        patch.setattr(torch, "masked_select", refuse("torch.masked_select"))
        patch.setattr(torch.Tensor, "__getitem__", dense_getitem)
        yield


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_steps_never_wait_for_the_device(kind: Kind, mode: AutoresetMode, monkeypatch: pytest.MonkeyPatch) -> None:
    envs = kind.cls(8, autoreset_mode=mode, max_episode_steps=kind.episode_steps)
    actions = kind.actions(500, 8, seed=4)
    envs.reset(seed=0)
    with no_host_sync(monkeypatch):
        outs = _record(envs, actions)  # in DISABLED mode with a masked reset at every step, as a loop does
    ends = sum(out[2] | out[3] for out in outs)
    assert (ends > 0).all(), "every env must have ended episodes, so that the autoresets were at stake"


def test_the_no_sync_check_catches_a_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.tensor([1.0, 2.0])
    with no_host_sync(monkeypatch), pytest.raises(AssertionError, match="host synchronisation"):
        _ = x[x > 1]
    with no_host_sync(monkeypatch), pytest.raises(AssertionError, match="host synchronisation"):
        if (x > 1).any():
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_steps_never_sync_and_match_the_cpu(kind: Kind, mode: AutoresetMode) -> None:
    actions = kind.actions(200, 8, seed=5)
    envs = {
        device: kind.cls(8, device=device, autoreset_mode=mode, max_episode_steps=kind.episode_steps)
        for device in ("cpu", "cuda")
    }
    for each in envs.values():
        each.reset(seed=0)
    on_cpu = _record(envs["cpu"], actions)
    on_cuda_actions = actions.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_cuda = _record(envs["cuda"], on_cuda_actions)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    infos = [value for out in on_cuda for value in out[4].values() if isinstance(value, Tensor)]
    assert all(t.device.type == "cuda" for t in [*infos, *(t for out in on_cuda for t in out[:4])])
    for cpu, cuda in zip(on_cpu, on_cuda):
        for a, b in zip(cpu[:4], cuda[:4]):
            torch.testing.assert_close(a, b.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_spaces_and_attributes_are_a_gymnasium_vector_envs(kind: Kind, mode: AutoresetMode) -> None:
    envs = kind.cls(5, autoreset_mode=mode.value)
    original = kind.gym_cls()
    assert envs.single_observation_space == original.observation_space
    assert envs.single_action_space == original.action_space
    assert envs.observation_space == spaces.Box(
        np.stack([original.observation_space.low] * 5), np.stack([original.observation_space.high] * 5)
    )
    if kind is CARTPOLE:
        assert envs.action_space == spaces.MultiDiscrete([2] * 5)
    else:
        assert envs.action_space == spaces.Box(-2.0, 2.0, (5, 1), np.float32)
    assert envs.metadata["autoreset_mode"] is envs.autoreset_mode is mode
    limit = gym.spec(kind.gym_id).max_episode_steps
    assert (envs.num_envs, envs.device, envs.max_episode_steps) == (5, torch.device("cpu"), limit)
    obs, infos = envs.reset(seed=0, options=None)
    assert obs.shape == envs.observation_space.shape and obs.dtype == torch.float32 and infos == {}
    obs, reward, terminated, truncated, _ = envs.step(torch.as_tensor(envs.action_space.sample()))
    assert (reward.dtype, terminated.dtype, truncated.dtype) == (torch.float32, torch.bool, torch.bool)
    assert reward.shape == terminated.shape == truncated.shape == (5,)
    envs.close()
    envs.close()
    assert envs.closed


@pytest.mark.parametrize("kind", KINDS)
def test_the_caller_owns_the_returned_tensors(kind: Kind) -> None:
    actions = kind.actions(40, 2, seed=6)
    clean = _run(kind.cls(2, autoreset_mode=AutoresetMode.SAME_STEP, max_episode_steps=7), actions, seed=0)
    envs = kind.cls(2, autoreset_mode=AutoresetMode.SAME_STEP, max_episode_steps=7)
    scribbled = [envs.reset(seed=0)[0].clone()]
    envs.reset(seed=0)[0].fill_(7.0)
    envs.reset(seed=0)
    for action in actions:
        out = envs.step(action)
        scribbled.extend(t.clone() for t in out[:4])
        for t in (*out[:4], out[4]["final_obs"]):
            t.zero_()
    _assert_same(clean, scribbled)


def _step_with(actions: Any, kind: Kind = CARTPOLE) -> Callable[[], Any]:
    def call() -> Any:
        envs = kind.cls(3)
        envs.reset(seed=0)
        return envs.step(actions)

    return call


def _reset_with(**reset: Any) -> Callable[[], Any]:
    def call() -> Any:
        envs = CartPole(3, autoreset_mode=AutoresetMode.DISABLED)
        envs.reset(seed=0)
        return envs.reset(**reset)

    return call


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        pytest.param(
            _step_with(torch.zeros(3, 1, dtype=torch.int64)),
            ValueError,
            "expected shape (3,), one action per env, got (3, 1)",
            id="cartpole-action-shape",
        ),
        pytest.param(
            _step_with(torch.zeros(3)),
            TypeError,
            "expected an integer tensor of 0 (push left) or 1 (push right) per env, got dtype torch.float32",
            id="cartpole-float-actions",
        ),
        pytest.param(
            _step_with(torch.zeros(3), PENDULUM),
            ValueError,
            "expected shape (3, 1), one torque per env, got (3,)",
            id="pendulum-action-shape",
        ),
        pytest.param(
            lambda: CartPole(3).step(torch.zeros(3, dtype=torch.int64)),
            RuntimeError,
            "step() before reset()",
            id="step-before-reset",
        ),
        pytest.param(
            lambda: CartPole(0), ValueError, "CartPole(num_envs=...): expected an int of at least 1", id="no-envs"
        ),
        pytest.param(
            lambda: Pendulum(2, autoreset_mode="Sometimes"),
            ValueError,
            "Pendulum(autoreset_mode='Sometimes'): expected one of AutoresetMode.NEXT_STEP ('NextStep')",
            id="autoreset-mode",
        ),
        pytest.param(
            lambda: CartPole(2, max_episode_steps=0),
            ValueError,
            "CartPole(max_episode_steps=...): expected an int of at least 1",
            id="max-episode-steps",
        ),
        pytest.param(_reset_with(seed=[1, 2]), ValueError, "got 2 seeds, expected one per env (3)", id="seed-list"),
        pytest.param(_reset_with(seed=-1), ValueError, "reset(seed=-1): env j is keyed seed + j", id="seed-range"),
        pytest.param(_reset_with(seed=1.5), TypeError, "reset(seed=1.5): expected an int", id="seed-type"),
        pytest.param(
            _reset_with(options={"reset_mask": torch.ones(2, dtype=torch.bool)}),
            ValueError,
            "expected a bool mask of shape (3,), got shape (2,)",
            id="mask-shape",
        ),
        pytest.param(
            _reset_with(options={"reset_mask": [True, False, True]}),
            TypeError,
            "expected a bool tensor or NumPy array of shape (3,), got list",
            id="mask-type",
        ),
        pytest.param(_reset_with(options={"low": -0.1}), ValueError, "unknown option(s) ['low']", id="option"),
        pytest.param(
            lambda: CartPole(2).reset(options={"reset_mask": torch.ones(2, dtype=torch.bool)}),
            RuntimeError,
            "before any full reset",
            id="mask-before-reset",
        ),
        pytest.param(
            lambda: CartPole(2).reset(seed=0, options={"reset_mask": torch.ones(2, dtype=torch.bool)}),
            RuntimeError,
            "before any full reset",
            id="seeded-mask-before-reset",
        ),
    ],
)
def test_errors_name_the_argument_the_value_and_the_fix(call: Callable[[], Any], error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_the_ids_work_in_a_fresh_interpreter_with_the_module_prefix():
    """gymnasium has no plugin hook: ``"torch_rollout:torch_rollout/CartPole-v1"`` imports the package first."""
    script = (
        "import gymnasium\n"
        "envs = gymnasium.make_vec('torch_rollout:torch_rollout/CartPole-v1', num_envs=3, device='cpu')\n"
        "obs, _ = envs.reset(seed=0)\n"
        "print(type(envs).__name__, tuple(obs.shape))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["CartPole", "(3,", "4)"]


@pytest.mark.skipif(importlib.util.find_spec("jax") is not None, reason="JAX is installed here")
def test_from_jax_imports_jax_only_when_made() -> None:
    """torch_rollout.envs.FromJax is there without JAX; making one says what to install (the real tests: sims/)."""
    code = (
        "import sys, torch_rollout.envs as envs; from torch_rollout.envs import FromJax; "
        "assert 'jax' not in sys.modules and FromJax is envs.FromJax; FromJax(object(), 1)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "ModuleNotFoundError: FromJax needs JAX" in done.stderr, done.stderr
