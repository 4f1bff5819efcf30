"""Collection throughput on CartPole-v1: torch_rollout against TorchRL, SB3, rlox, a CleanRL-style loop and two floors.

Every system collects batches of T x N transitions with the same 64x64 tanh
actor-critic (same weights, same env seeds, one torch thread) and computes GAE
on each batch its own way. The unit is real transitions per second: rows that
are only an env reset (gymnasium's NEXT_STEP autoreset) are not counted.

The gymnasium-based systems all step CartPole-v1 one env at a time in a
``SyncVectorEnv`` (SB3 in its equivalent ``DummyVecEnv``; TorchRL and rlox's
gymnasium path in SAME_STEP mode, which they require), the env the gymnasium
floor steps. rlox's native path steps its own Rust CartPole. One more
torch_rollout row passes the env id, for which ``gymnasium.make_vec`` builds the
NumPy-vectorised ``CartPoleVectorEnv``: a different, faster env, shown apart.

torch_rollout runs in both of its placements: ``backend="thread"`` on the live
``SyncVectorEnv`` (prefetch 0 and 1), and ``backend="process"`` with K = 1 or 2
worker processes (prefetch 1), each building its share of the same
``SyncVectorEnv`` from the picklable recipe
``functools.partial(gymnasium.make_vec, "CartPole-v1", vectorization_mode="sync")``.

Usage::

    benchmarks/.venv/bin/python benchmarks/collect.py [--quick] [--repeats R] [--num-envs 8 64]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from _common import (
    ActorCritic,
    CleanRLRollout,
    CollectorSession,
    EnvAlone,
    PolicyAlone,
    Session,
    TorchRLSession,
    cpu_collector,
    has,
    machine_info,
    main_of,
    make_policy,
    markdown_table,
    quiet_warnings,
    rate_cells,
    recorded_obs,
    run_interleaved,
    summarize,
    write_json,
)

__all__ = ["run", "REFERENCE", "sync_recipe"]

ENV_ID = "CartPole-v1"
GAMMA, GAE_LAMBDA = 0.99, 0.95
REFERENCE = "torch_rollout thread (prefetch=1)"
LOCKSTEP = "torch_rollout thread (prefetch=0)"
PROCESS_K1 = "torch_rollout process K=1 (prefetch=1)"
PROCESS_K2 = "torch_rollout process K=2 (prefetch=1)"


def _policy(state: dict[str, torch.Tensor], seed: int) -> ActorCritic:
    """A fresh copy of the shared weights; reseeds torch so every system samples actions from the same stream."""
    policy = make_policy(seed)
    policy.load_state_dict(state)
    torch.manual_seed(seed)
    return policy


# ------------------------------------------------------------------------------ systems


def sync_recipe(env_id: str = ENV_ID) -> functools.partial:
    """``make_envs(num_envs)`` for worker processes: the same ``SyncVectorEnv`` the thread rows step."""
    return functools.partial(gym.make_vec, env_id, vectorization_mode="sync")


def torch_rollout(
    num_envs: int,
    num_steps: int,
    seed: int,
    state: dict,
    *,
    prefetch: int,
    env_id: str = ENV_ID,
    autoreset_mode: gym.vector.AutoresetMode | None = None,
    env_id_only: bool = False,
    backend: str = "thread",
    num_workers: int = 1,
    compile_policy: bool = False,
) -> CollectorSession:
    """torch_rollout's Collector on a gymnasium ``SyncVectorEnv`` (NEXT_STEP unless ``autoreset_mode`` says otherwise).

    ``backend="thread"`` gets the live vector env; ``backend="process"`` gets
    :func:`sync_recipe` and ``num_workers`` processes each build their share of it.
    With ``env_id_only`` the Collector gets the env id and builds the env itself with
    ``gymnasium.make_vec``'s default, which for CartPole is gymnasium's NumPy-vectorised
    ``CartPoleVectorEnv``, not a ``SyncVectorEnv``.
    """
    live = None
    if env_id_only:
        envs: Any = env_id
    elif backend == "process":
        if autoreset_mode is not None:
            raise ValueError("torch_rollout: autoreset_mode is only set for backend='thread'")
        envs = sync_recipe(env_id)
    else:
        vector_kwargs = {} if autoreset_mode is None else {"autoreset_mode": autoreset_mode}
        live = envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync", vector_kwargs=vector_kwargs)
    return cpu_collector(
        envs,
        _policy(state, seed),
        owned=live,
        backend=backend,
        num_workers=num_workers,
        num_steps=num_steps,
        num_envs=None if live is not None else num_envs,
        prefetch=prefetch,
        seed=seed,
        compile_policy=compile_policy,
    )


def torchrl(num_envs: int, num_steps: int, seed: int, state: dict, *, env_id: str = ENV_ID, env: Any = None) -> Any:
    """TorchRL's ``Collector`` on a SAME_STEP gymnasium vector env (or ``env``), then its ``GAE`` module."""
    from tensordict.nn import TensorDictModule
    from torchrl.envs import GymWrapper

    policy = _policy(state, seed)
    if env is None:
        vec = gym.vector.SyncVectorEnv(
            [lambda: gym.make(env_id) for _ in range(num_envs)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
        )
        env = GymWrapper(vec, categorical_action_encoding=True, device="cpu")
    env.set_seed(seed)
    actor = TensorDictModule(
        policy.get_action_and_logprob, in_keys=["observation"], out_keys=["action", "sample_log_prob"]
    )
    critic = TensorDictModule(policy.critic, in_keys=["observation"], out_keys=["state_value"])
    return TorchRLSession(env, actor, critic, frames_per_batch=num_steps * num_envs, gamma=GAMMA, gae_lambda=GAE_LAMBDA)


class StableBaselines3:
    """SB3's ``PPO.collect_rollouts`` into its ``RolloutBuffer`` (which computes GAE) on a DummyVecEnv."""

    def __init__(self, num_envs: int, num_steps: int, seed: int, state: dict, *, env_id: str = ENV_ID) -> None:
        from stable_baselines3 import PPO
        from stable_baselines3.common.env_util import make_vec_env

        self.num_envs, self.num_steps = num_envs, num_steps
        venv = make_vec_env(env_id, n_envs=num_envs, seed=seed)
        self.model = PPO(
            "MlpPolicy",
            venv,
            n_steps=num_steps,
            batch_size=min(256, num_steps * num_envs),
            gamma=GAMMA,
            gae_lambda=GAE_LAMBDA,
            device="cpu",
            seed=seed,
            policy_kwargs=sb3_policy_kwargs(),
        )
        load_sb3_weights(self.model.policy, state)
        torch.manual_seed(seed)
        _, self.callback = self.model._setup_learn(total_timesteps=2**62, callback=None)

    def step(self) -> int:
        self.model.collect_rollouts(
            self.model.env, self.callback, self.model.rollout_buffer, n_rollout_steps=self.num_steps
        )
        return self.num_steps * self.num_envs

    def close(self) -> None:
        self.model.env.close()


def sb3_policy_kwargs() -> dict[str, Any]:
    """SB3's MlpPolicy shaped like ActorCritic: separate 64x64 tanh actor and critic."""
    return {"net_arch": {"pi": [64, 64], "vf": [64, 64]}, "activation_fn": torch.nn.Tanh}


def load_sb3_weights(sb3_policy: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copies ActorCritic weights into an SB3 ActorCriticPolicy built with ``sb3_policy_kwargs``."""
    names = {
        "actor.0": "mlp_extractor.policy_net.0",
        "actor.2": "mlp_extractor.policy_net.2",
        "actor.4": "action_net",
        "critic.0": "mlp_extractor.value_net.0",
        "critic.2": "mlp_extractor.value_net.2",
        "critic.4": "value_net",
    }
    mapped = {}
    for key, tensor in state.items():
        module, param = key.rsplit(".", 1)
        mapped[f"{names[module]}.{param}"] = tensor
    sb3_policy.load_state_dict(mapped, strict=False)  # strict=False: SB3 keeps extra (empty) extractor modules
    missing = set(mapped) - set(sb3_policy.state_dict())
    if missing:
        raise RuntimeError(f"SB3 policy lacks {sorted(missing)}")


class Rlox:
    """rlox's ``RolloutCollector``: its native Rust CartPole, or its gymnasium path (``GymVecEnv``, SAME_STEP)."""

    def __init__(
        self, num_envs: int, num_steps: int, seed: int, state: dict, *, native: bool, env_id: str = ENV_ID
    ) -> None:
        from rlox.collectors import RolloutCollector
        from rlox.gym_vec_env import GymVecEnv

        env = None if native else GymVecEnv(env_id, n_envs=num_envs, seed=seed)
        self.collector = RolloutCollector(
            env_id, n_envs=num_envs, seed=seed, gamma=GAMMA, gae_lambda=GAE_LAMBDA, env=env
        )
        self.policy = _policy(state, seed)
        self.num_steps, self.num_envs = num_steps, num_envs

    def step(self) -> int:
        self.last = self.collector.collect(self.policy, n_steps=self.num_steps)  # flat [T * N], T-major
        return self.num_steps * self.num_envs

    def close(self) -> None:
        close = getattr(self.collector.env, "close", None)
        if close is not None:
            close()


def cleanrl_style(num_envs: int, num_steps: int, seed: int, state: dict, *, env_id: str = ENV_ID) -> CleanRLRollout:
    """The loop CleanRL's ppo.py writes, on the SyncVectorEnv in NEXT_STEP mode."""
    envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync")
    first, _ = envs.reset(seed=seed)
    agent = _policy(state, seed)
    return CleanRLRollout(
        envs, agent, first, num_steps=num_steps, num_envs=num_envs, gamma=GAMMA, gae_lambda=GAE_LAMBDA
    )


def env_floor(num_envs: int, num_steps: int, seed: int, state: dict, *, backend: str = "gymnasium") -> EnvAlone:
    """The vector env alone, stepped with pre-drawn random actions: no collector can beat this on the same env.

    ``backend``: "gymnasium" (the SyncVectorEnv the collectors use), "gymnasium-vector"
    (``make_vec``'s default for CartPole, the NumPy ``CartPoleVectorEnv``), "envpool" or "rlox".
    """
    actions = np.random.default_rng(seed).integers(0, 2, size=(num_steps, num_envs))
    if backend in ("gymnasium", "gymnasium-vector"):
        env = gym.make_vec(ENV_ID, num_envs=num_envs, vectorization_mode="sync" if backend == "gymnasium" else None)
        env.reset(seed=seed)
        return EnvAlone(env, actions, num_envs=num_envs)
    if backend == "envpool":
        import envpool

        env = envpool.make(ENV_ID, env_type="gymnasium", num_envs=num_envs, seed=seed)
        env.reset()
        return EnvAlone(env, actions.astype(np.int32), num_envs=num_envs)
    if backend == "rlox":
        import rlox

        env = rlox.VecEnv(n=num_envs, seed=seed, env_id=ENV_ID)
        env.reset_all()
        # rlox takes a list of ints and has no close
        return EnvAlone(None, [row.tolist() for row in actions], num_envs=num_envs, step=env.step_all)
    raise ValueError(f"env_floor: unknown backend {backend!r}")


def policy_floor(num_envs: int, num_steps: int, seed: int, state: dict, *, compiled: bool = False) -> PolicyAlone:
    """The policy forward alone (sample, log-prob, value) on T pre-recorded CartPole observation batches.

    ``compiled``: through ``torch.compile`` (compiled by the untimed warm-up).
    """
    envs = gym.make_vec(ENV_ID, num_envs=num_envs, vectorization_mode="sync")
    first, _ = envs.reset(seed=seed)
    obs = recorded_obs(envs, first, np.random.default_rng(seed).integers(0, 2, size=(num_steps, num_envs)))
    envs.close()
    policy = _policy(state, seed)
    return PolicyAlone(
        torch.compile(policy.eval().requires_grad_(False)) if compiled else policy, obs, num_envs=num_envs
    )


def systems(
    num_envs: int, num_steps: int, seed: int, state: dict
) -> tuple[dict[str, Callable[[], Session]], list[str]]:
    """Factories of every system that can run here, and notes on the ones that cannot."""
    args = (num_envs, num_steps, seed, state)
    factories: dict[str, Callable[[], Session]] = {
        REFERENCE: lambda: torch_rollout(*args, prefetch=1),
        LOCKSTEP: lambda: torch_rollout(*args, prefetch=0),
        # worker processes, each stepping its share of the same SyncVectorEnv
        PROCESS_K1: lambda: torch_rollout(*args, prefetch=1, backend="process", num_workers=1),
        PROCESS_K2: lambda: torch_rollout(*args, prefetch=1, backend="process", num_workers=2),
        # what Collector("CartPole-v1", ...) builds from an env id: another env implementation
        "torch_rollout thread (prefetch=1), env id: CartPoleVectorEnv": lambda: torch_rollout(
            *args, prefetch=1, env_id_only=True
        ),
    }
    notes = []
    peers = {
        ("torchrl", "TorchRL"): {"TorchRL Collector + GAE": lambda: torchrl(*args)},
        ("stable_baselines3", "stable-baselines3"): {"SB3 PPO.collect_rollouts": lambda: StableBaselines3(*args)},
        ("rlox", "rlox"): {
            "rlox RolloutCollector (gymnasium)": lambda: Rlox(*args, native=False),
            "rlox RolloutCollector (native CartPole)": lambda: Rlox(*args, native=True),
        },
    }
    for (module, label), rows in peers.items():
        if has(module):
            factories.update(rows)
        else:
            notes.append(f"{label} not installed: skipped")
    factories["CleanRL-style loop"] = lambda: cleanrl_style(*args)
    factories["floor: gymnasium SyncVectorEnv stepping alone"] = lambda: env_floor(*args)
    factories["floor: policy forward alone"] = lambda: policy_floor(*args)
    # other env back-ends: what the env floor would be with another CartPole implementation
    factories["ref: gymnasium CartPoleVectorEnv stepping alone"] = lambda: env_floor(*args, backend="gymnasium-vector")
    if has("envpool"):
        factories["ref: envpool env stepping alone"] = lambda: env_floor(*args, backend="envpool")
    else:
        notes.append("envpool not installed: its env floor skipped")
    if has("rlox"):
        factories["ref: rlox VecEnv stepping alone"] = lambda: env_floor(*args, backend="rlox")
    return factories, notes


# ------------------------------------------------------------------------------ driver


def setup(
    quick: bool, repeats: int | None, num_envs: list[int] | None, num_steps: int, seed: int
) -> tuple[int, list[int], dict[str, torch.Tensor], dict[str, Any]]:
    """A CartPole run's defaults (1 repeat and N=8 quick; 5 and N=8, 64 full), weights and results' head;
    one torch thread, the peers' warnings silenced."""
    quiet_warnings()
    torch.set_num_threads(1)
    results: dict[str, Any] = {"machine": machine_info()}
    repeats = repeats or (1 if quick else 5)
    results["config"] = {"T": num_steps, "repeats": repeats, "seed": seed}
    results["tables"] = {}
    return repeats, num_envs or ([8] if quick else [8, 64]), make_policy(seed).state_dict(), results


def run(
    *,
    quick: bool = False,
    repeats: int | None = None,
    num_envs: list[int] | None = None,
    num_steps: int = 128,
    seed: int = 0,
    only: list[str] | None = None,
    timed_batches: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Runs the collection benchmark and returns its results (also written to results/collect.json).

    Args:
        quick: one repeat, N=8 only, one timed batch: checks that every system runs.
        repeats: interleaved rounds (default 1 quick, 5 full).
        num_envs: the N values to run (default [8] quick, [8, 64] full).
        num_steps: T, steps per env per batch.
        seed: env and weight seed shared by all systems.
        only: run only the systems whose names contain one of these strings (the reference always
            runs); the results then go to results/collect_only.json.
        timed_batches: timed batches per system per repeat (default: about 3k transitions).
        log: where progress lines go.

    Returns:
        A dict with ``machine``, ``config`` and, per N, ``rows`` from :func:`summarize`.
    """
    repeats, num_envs, state, results = setup(quick, repeats, num_envs, num_steps, seed)
    for n in num_envs:
        # at least ~3k timed transitions per system per repeat; one warm-up batch before
        timed = timed_batches or (1 if quick else max(1, 3072 // (n * num_steps)))
        factories, notes = systems(n, num_steps, seed, state)
        if only:
            factories = {k: f for k, f in factories.items() if k == REFERENCE or any(part in k for part in only)}
        log(f"collect: N={n} T={num_steps}, {repeats} repeat(s), {timed} timed batch(es) after 1 warm-up")
        rates = run_interleaved(factories, repeats=repeats, warmup=1, steps=timed, log=log)
        results["tables"][str(n)] = {
            "num_envs": n,
            "timed_batches": timed,
            "notes": notes,
            "samples": rates,
            "rows": summarize(rates, REFERENCE),
        }
    results["config"]["quick"] = quick
    results["config"]["only"] = only
    write_json("collect_quick" if quick else "collect_only" if only else "collect", results)
    return results


def to_markdown(results: dict[str, Any]) -> str:
    """The collection tables, one per N."""
    parts = []
    for table in results["tables"].values():
        rows = [rate_cells(r) for r in table["rows"]]
        title = f"Collection, CartPole-v1, T={results['config']['T']} x N={table['num_envs']}, GAE included"
        parts.append(f"**{title}** (transitions/s, median of {results['config']['repeats']})\n\n")
        parts.append(markdown_table(["system", "median", "range", "vs thread, prefetch=1"], rows))
        verdict = process_verdict(table)
        if verdict:
            parts.append(f"\n\n{verdict}")
        for note in table["notes"]:
            parts.append(f"\n\n_{note}_")
        parts.append("\n\n")
    return "".join(parts).rstrip() + "\n"


def process_verdict(table: dict[str, Any]) -> str:
    """One line: the process rows against both thread rows."""
    med = {r["system"]: r["median"] for r in table["rows"]}
    threads = [name for name in (LOCKSTEP, REFERENCE) if name in med]
    if PROCESS_K1 not in med or not threads:
        return ""
    parts = []
    for name in (PROCESS_K1, PROCESS_K2):
        if name in med:
            vs = ", ".join(f"{med[name] / med[t]:.2f}x thread prefetch={t[-2]}" for t in threads)
            parts.append(f"{name.split(' (')[0].removeprefix('torch_rollout process ')}: {vs}")
    return (
        f"Process backend vs thread: {'; '.join(parts)} (medians of fresh builds; `benchmarks/placement_ab.py` "
        "measures K=1 against the thread in paired rounds)."
    )


OPTIONS = (
    ("--num-envs", {"type": int, "nargs": "+", "default": None}),
    ("--seed", {"type": int, "default": 0}),
    ("--only", {"nargs": "+", "default": None, "help": "systems whose names contain one of these"}),
    ("--timed-batches", {"type": int, "default": None, "help": "timed batches per system per repeat"}),
)  # the command line beyond --quick and --repeats


def main() -> None:
    main_of(__doc__, run, to_markdown, *OPTIONS)


if __name__ == "__main__":
    main()
