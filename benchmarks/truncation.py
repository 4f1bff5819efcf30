"""Correctness at time-limit truncations: each system's GAE advantages against the exact ones, printed, not asserted.

The env is a chain that never terminates and is truncated by a ``TimeLimit``
after ``LIMIT`` steps. Its observation encodes the step ``k`` within the
episode and its reward is ``1 + 0.1 k``, whatever the action, so the true
transitions are known in advance: the exact advantage of any row follows from
the critic alone. At a truncated step the exact target bootstraps from the
value of the final observation (``k = LIMIT``) and the GAE trace stops there.

Every system runs the same critic; rows are matched to the truth through the
``k`` in their observation. A row whose observation is the final one
(``k = LIMIT``) is not a transition at all: it is the reset step of gymnasium's
NEXT_STEP autoreset. Whether such rows reach the loss is reported too.

Usage::

    benchmarks/.venv/bin/python benchmarks/truncation.py
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import collect
import gymnasium as gym
import numpy as np
import torch

from _common import machine_info, main_of, make_policy, markdown_table, quiet_warnings, record

__all__ = ["run", "TimeLimitedChain", "ENV_ID"]

ENV_ID = "TruncationChain-v0"
LIMIT = 5  # steps before the TimeLimit truncates
GAMMA, GAE_LAMBDA = collect.GAMMA, collect.GAE_LAMBDA


def chain_obs(k: int) -> np.ndarray:
    """Observation at step ``k`` of an episode; ``k`` is recovered from its first component."""
    x = k / LIMIT
    return np.array([x, x * x, 1.0 - x, 0.5], dtype=np.float32)


def chain_reward(k: int) -> float:
    """Reward of the step taken from step ``k``."""
    return 1.0 + 0.1 * k


class TimeLimitedChain(gym.Env):
    """Never terminates; ``gym.make`` adds a ``TimeLimit`` of ``LIMIT`` steps (registered as ``ENV_ID``)."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(4,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, render_mode: str | None = None) -> None:
        # an explicit signature: TorchRL's GymEnv probes constructors with extra kwargs
        self.render_mode = render_mode
        self.k = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.k = 0
        return chain_obs(0), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward = chain_reward(self.k)
        self.k += 1
        return chain_obs(self.k), reward, False, False, {}


if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point=TimeLimitedChain, max_episode_steps=LIMIT)


def exact_advantages(steps: np.ndarray, critic: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Exact GAE for one env's rows (episode steps ``steps`` [T], ``LIMIT`` marking reset rows) within one batch.

    Reset rows get NaN. A row's trace runs on through the next real row of the same
    episode in the batch; at a truncation or at the batch's last real row it stops
    (the row bootstraps from the value of its true next observation).
    """
    values = {k: float(critic(chain_obs(k)[None])[0]) for k in range(LIMIT + 1)}
    out = np.full(len(steps), np.nan)
    next_adv = 0.0
    next_k: int | None = None
    for t in reversed(range(len(steps))):
        k = int(steps[t])
        if k == LIMIT:
            continue
        delta = chain_reward(k) + GAMMA * values[k + 1] - values[k]
        # the trace continues only into the same episode's next step
        continues = next_k == k + 1 and k + 1 < LIMIT
        out[t] = delta + (GAMMA * GAE_LAMBDA * next_adv if continues else 0.0)
        next_adv, next_k = out[t], k
    return out


# Each extractor returns, for a system's last batch: obs [T, N, 4], advantage [T, N], a [T, N]
# bool of the rows its loss uses, and a diagnostic line read from the batch (or "").

Extracted = tuple[np.ndarray, np.ndarray, np.ndarray, str]


def _truncated_rows(obs: np.ndarray) -> np.ndarray:
    return np.rint(obs[..., 0] * LIMIT).astype(int) == LIMIT - 1


def _torch_rollout(session: Any) -> Extracted:
    batch = session.last
    return batch["obs"].numpy(), batch["advantage"].numpy(), batch["mask"].numpy(), ""


def _torchrl(session: Any) -> Extracted:
    batch = session.last  # [N, T]
    obs = batch["observation"].transpose(0, 1).numpy()
    adv = batch["advantage"].squeeze(-1).transpose(0, 1).numpy()
    next_obs = batch["next", "observation"].transpose(0, 1).numpy()
    truncated = _truncated_rows(obs)
    zeros = int((np.abs(next_obs[truncated]).sum(-1) == 0).sum())
    note = f"next observation all zeros at {zeros}/{int(truncated.sum())} truncations" if zeros else ""
    return obs, adv, np.ones(adv.shape, dtype=bool), note


def _sb3(session: collect.StableBaselines3) -> Extracted:
    buffer = session.model.rollout_buffer  # NumPy [T, N, ...]
    return buffer.observations, buffer.advantages, np.ones(buffer.advantages.shape, dtype=bool), ""


def _rlox(session: collect.Rlox) -> Extracted:
    batch = session.last  # flat, T-major
    T, N = session.num_steps, session.num_envs
    obs, adv = batch.obs.reshape(T, N, -1).numpy(), batch.advantages.reshape(T, N).numpy()
    truncated = _truncated_rows(obs)
    # batch.dones holds the flags its GAE cut the trace on
    open_ends = int((batch.dones.reshape(T, N).numpy()[truncated] == 0).sum())
    note = f"GAE done flag 0 at {open_ends}/{int(truncated.sum())} truncations" if open_ends else ""
    return obs, adv, np.ones(adv.shape, dtype=bool), note


def _cleanrl(session: Any) -> Extracted:
    # CleanRL trains on every row, the NEXT_STEP reset rows included
    return session.obs.numpy(), session.advantages.numpy(), np.ones(session.advantages.shape, dtype=bool), ""


def torchrl_gym_env(num_envs: int, num_steps: int, seed: int, state: dict, *, env_id: str) -> Any:
    """TorchRL with ``GymEnv(env_id, num_envs=N)``: TorchRL builds the gymnasium vector env itself."""
    from torchrl.envs import GymEnv

    env = GymEnv(env_id, num_envs=num_envs, categorical_action_encoding=True, device="cpu")
    return collect.torchrl(num_envs, num_steps, seed, state, env=env)


def systems(
    num_envs: int, num_steps: int, seed: int, state: dict, *, quick: bool = False
) -> dict[str, tuple[Callable[[], Any], Callable]]:
    """name -> (factory of a collect.py session on the chain env, extractor).

    ``quick`` leaves out TorchRL's ``GymEnv(num_envs=N)``: its AsyncVectorEnv spawns
    worker processes that re-import everything, several seconds on two cores.
    """
    args = (num_envs, num_steps, seed, state)
    mode = gym.vector.AutoresetMode
    out: dict[str, tuple[Callable[[], Any], Callable]] = {
        "torch_rollout (NEXT_STEP)": (lambda: collect.torch_rollout(*args, prefetch=0, env_id=ENV_ID), _torch_rollout),
        "torch_rollout (SAME_STEP)": (
            lambda: collect.torch_rollout(*args, prefetch=0, env_id=ENV_ID, autoreset_mode=mode.SAME_STEP),
            _torch_rollout,
        ),
        "torch_rollout (DISABLED)": (
            lambda: collect.torch_rollout(*args, prefetch=0, env_id=ENV_ID, autoreset_mode=mode.DISABLED),
            _torch_rollout,
        ),
    }
    if importlib.util.find_spec("torchrl") is not None:
        out["TorchRL GymWrapper(SAME_STEP) + GAE"] = (lambda: collect.torchrl(*args, env_id=ENV_ID), _torchrl)
        if not quick:
            out["TorchRL GymEnv(num_envs=N) + GAE"] = (lambda: torchrl_gym_env(*args, env_id=ENV_ID), _torchrl)
    if importlib.util.find_spec("stable_baselines3") is not None:
        out["SB3 collect_rollouts"] = (lambda: collect.StableBaselines3(*args, env_id=ENV_ID), _sb3)
    if importlib.util.find_spec("rlox") is not None:
        out["rlox RolloutCollector (gymnasium)"] = (lambda: collect.Rlox(*args, native=False, env_id=ENV_ID), _rlox)
    out["CleanRL-style loop"] = (lambda: collect.cleanrl_style(*args, env_id=ENV_ID), _cleanrl)
    return out


def run(
    *, quick: bool = False, num_envs: int = 2, num_steps: int = 16, seed: int = 0, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Collects two batches per system on the chain env; compares the second batch's advantages with the exact ones.

    The second batch is the one compared so that an episode crosses the batch boundary.
    ``quick`` skips the slow TorchRL ``GymEnv`` row and writes results/truncation_quick.json.

    Returns:
        A dict with ``rows``: per system, the largest error at truncated steps and at the
        other real steps, the reset rows that reach the loss, and one worked example.
    """
    quiet_warnings()
    torch.set_num_threads(1)
    policy = make_policy(seed)
    state = policy.state_dict()

    def critic(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return policy.get_value(torch.as_tensor(obs, dtype=torch.float32)).double().numpy()

    rows = []
    for name, (factory, extract) in systems(num_envs, num_steps, seed, state, quick=quick).items():
        row: dict[str, Any] = {"system": name}
        session = None
        try:
            session = factory()
            session.step()
            session.step()
            obs, adv, in_loss, note = extract(session)
        except Exception as error:  # a peer that cannot run this env is reported, not fatal
            row["error"] = f"{type(error).__name__}: {error}"
            log(f"truncation: {name}: {row['error']}")
            rows.append(row)
            continue
        finally:
            if session is not None:
                session.close()
        steps = np.rint(obs[..., 0] * LIMIT).astype(int)  # [T, N]
        exact = np.stack([exact_advantages(steps[:, i], critic) for i in range(steps.shape[1])], axis=1)
        real = steps < LIMIT
        truncated = steps == LIMIT - 1
        err = np.abs(adv - exact)
        row["real_rows"] = int(real.sum())
        row["note"] = note
        row["reset_rows_in_loss"] = int((~real & in_loss).sum())
        row["max_err_truncated"] = float(err[truncated].max()) if truncated.any() else float("nan")
        row["max_err_other"] = float(err[real & ~truncated].max()) if (real & ~truncated).any() else float("nan")
        t, i = np.argwhere(truncated)[0]
        row["example"] = {"t": int(t), "env": int(i), "exact": float(exact[t, i]), "got": float(adv[t, i])}
        log(
            f"truncation: {name}: max |A - exact| at truncated steps {row['max_err_truncated']:.3g}, "
            f"elsewhere {row['max_err_other']:.3g}, reset rows in the loss {row['reset_rows_in_loss']}"
        )
        rows.append(row)
    results = {
        "machine": machine_info(),
        "config": {
            "env": ENV_ID,
            "limit": LIMIT,
            "num_envs": num_envs,
            "num_steps": num_steps,
            "gamma": GAMMA,
            "gae_lambda": GAE_LAMBDA,
            "seed": seed,
        },
        "rows": rows,
    }
    return record("truncation", results, quick=quick)


def to_markdown(results: dict[str, Any]) -> str:
    """The truncation table."""
    cfg = results["config"]
    rows = []
    for r in results["rows"]:
        if "error" in r:
            rows.append([r["system"], "failed: " + r["error"].replace("|", "/")[:120], "", "", "", ""])
            continue
        ex = r["example"]
        rows.append(
            [
                r["system"],
                f"{r['max_err_truncated']:.2e}",
                f"{r['max_err_other']:.2e}",
                r["reset_rows_in_loss"],
                f"{ex['exact']:.4f} / {ex['got']:.4f}",
                r["note"],
            ]
        )
    header = [
        "system",
        "max abs err, truncated steps",
        "max abs err, other steps",
        "reset rows in loss",
        "example: exact / got",
        "read from its batch",
    ]
    title = (
        f"**Advantages at time-limit truncations** (chain env, TimeLimit {cfg['limit']}, "
        f"T={cfg['num_steps']} x N={cfg['num_envs']}, gamma={cfg['gamma']}, lambda={cfg['gae_lambda']})"
    )
    return f"{title}\n\n{markdown_table(header, rows)}\n"


OPTIONS = (("--seed", {"type": int, "default": 0}),)  # the command line beyond --quick and --repeats


def main() -> None:
    main_of(
        __doc__,
        run,
        to_markdown,
        *OPTIONS,
        quick="without TorchRL's GymEnv row; writes results/truncation_quick.json",
        repeats=None,
    )


if __name__ == "__main__":
    main()
