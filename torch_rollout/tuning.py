"""Choosing a placement by measuring it: short, interleaved trials of each placement on your envs and policy.

:func:`tune` builds a Collector for each candidate placement (lockstep on the
thread, the thread collecting ahead, ``Processes(k)`` for each ``k`` the cores
and envs allow), times ``for batch in collector`` on each in turn, round after
round, and prints a table of frames per second with each one's account from
:meth:`Collector.stats`. ``python -m torch_rollout tune ENV_ID ...`` runs it
from the command line (``torch_rollout/__main__.py``), with a small MLP policy
unless given one.
"""

from __future__ import annotations

import inspect
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch
from gymnasium import spaces
from gymnasium.vector import VectorEnv
from torch import Tensor, nn
from torch.distributions import Categorical, Distribution, Independent, Normal

from torch_rollout.collector import Collector
from torch_rollout.envs._gym import build_envs
from torch_rollout.loop._arguments import check_int, resolve_num_envs
from torch_rollout.loop._stats import Stats, available_cores, record_tuned, tuned_key
from torch_rollout.placements._backends import Backend, Processes
from torch_rollout.placements._forkserver import start_workers_early

__all__ = ["MLPPolicy", "default_placements", "tune"]

ROUNDS = 3  # each placement is timed once per round; the table gives the median of the rounds and their range
WARMUP_BATCHES = 2  # per trial, before its account is reset: start-up, first forward passes, compiling if any
# The Collector's own arguments that tune() sets for every trial: a placement cannot set them.
_FIXED = ("envs", "policy", "num_envs", "num_steps", "device", "total_timesteps")


def default_placements(num_envs: int) -> list[dict[str, Any]]:
    """The placements that :func:`tune` tries by default, as Collector keyword arguments.

    Lockstep on the thread, the thread collecting one batch ahead, and one batch
    ahead in ``k`` worker processes for ``k`` from 1 to the cores this process
    may run on (and at most ``num_envs``: each worker needs an env). Ray is left
    out: pass it to :func:`tune` in ``placements`` to try it.

    Examples:
        >>> from torch_rollout.loop._stats import available_cores
        >>> placements = default_placements(num_envs=8)
        >>> placements[0], placements[2]
        ({'backend': 'thread', 'prefetch': 0}, {'backend': Processes(num_workers=1), 'prefetch': 1})
        >>> len(placements) == 2 + min(available_cores(), 8)
        True
    """
    threads: list[dict[str, Any]] = [{"backend": "thread", "prefetch": 0}, {"backend": "thread", "prefetch": 1}]
    workers = range(1, min(available_cores(), num_envs) + 1)
    return threads + [{"backend": Processes(num_workers=k), "prefetch": 1} for k in workers]


def tune(
    envs: VectorEnv | str | Callable[..., VectorEnv],
    policy: nn.Module | None = None,
    *,
    num_steps: int,
    num_envs: int | None = None,
    seconds: float = 20.0,
    train_seconds: float = 0.0,
    placements: Sequence[Mapping[str, Any]] | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """Times each placement that applies to ``envs`` and ``policy``, prints a table, and returns the fastest.

    Each trial builds a fresh :class:`Collector` with the placement's arguments,
    takes ``WARMUP_BATCHES`` (2) batches untimed (workers' start-up, the first
    forward passes, ``torch.compile`` if the policy uses it), resets the
    collector's account (``stats(reset=True)``), then times
    ``for batch in collector`` taking each batch at once, GAE included, for its
    share of ``seconds``, and closes the collector. The placements take turns:
    ``ROUNDS`` (3) rounds of one trial each (A B C, A B C, A B C), so that a
    change in the machine's load falls on all of them. The table gives each
    placement's median frames per second with the range of its rounds, its
    ratio to the first row, the shares of the collection loops' time (``env``,
    ``policy``, ``collector``, ``idle``, from :meth:`Collector.stats` summed
    over the rounds) and the share of the trainer's time spent waiting in
    ``next()``. A placement that the Collector refuses (a live vector env in
    worker processes, envs or a policy that do not pickle, a split of the envs
    that a recipe refuses) gets a row saying why, and is not tried again.
    A Collector of the same ``envs``, ``num_envs`` and ``num_steps`` in this
    process leaves the placements measured slower out of its ``stats()``
    verdict, as the table's own account line does.

    What it measures is collection as a trainer that does nothing else sees
    it. A trainer that trains between batches favours the placements that
    collect while it trains (``prefetch=1``, worker processes); with
    ``train_seconds`` the trainer runs Adam steps of a 64x64 MLP on the CPU for
    that long after each batch, a stand-in for a CPU update. The trainer's torch
    threads are yours (``torch.get_num_threads()``, printed): set them as your
    trainer does before calling.

    Args:
        envs: as the Collector's: a live :class:`gymnasium.vector.VectorEnv` (the
            thread's placements only), an env id, or a function ``make_envs(num_envs)``.
        policy: as the Collector's; ``None``: a 64x64 tanh MLP actor-critic built for the
            envs' spaces (:class:`MLPPolicy`; Box observations, Discrete or Box actions).
        num_steps: steps per env per batch, as you will collect.
        num_envs: envs, as you will collect (a live vector env's own when ``None``).
        seconds: the timed seconds in all, split evenly over the trials; building the
            collectors and their warm-up come on top.
        train_seconds: seconds of a stand-in CPU update after each batch (0: none).
        placements: the Collector keyword arguments to try, e.g.
            ``[{"backend": "thread", "prefetch": 0}, {"backend": Ray(num_workers=2), "prefetch": 1}]``;
            ``None``: :func:`default_placements`.
        device: as the Collector's (``None``: CUDA when available, else the CPU).

    Returns:
        The fastest placement's keyword arguments, for
        ``Collector(envs, policy, num_steps=..., num_envs=..., device=..., **best)``.
        (``python -m torch_rollout tune ... --json PATH`` also writes every trial's figures to a file.)

    Raises:
        TypeError, ValueError: for an argument out of type or range; and the
            Collector's own error when it refuses every placement.

    Examples:
        >>> previous = torch.get_num_threads()
        >>> torch.set_num_threads(1)  # as the trainer will run: tune measures with the caller's setting
        >>> lockstep, ahead = {"backend": "thread", "prefetch": 0}, {"backend": "thread", "prefetch": 1}
        >>> best = tune("CartPole-v1", num_envs=2, num_steps=8, seconds=0.3, device="cpu",
        ...             placements=[lockstep, ahead])  # doctest: +ELLIPSIS
        torch_rollout.tune: envs='CartPole-v1', num_envs=2, num_steps=8, device=cpu, ...
        | placement | frames/s (median) | ...
        >>> best in (lockstep, ahead)
        True
        >>> torch.set_num_threads(previous)
    """
    _, best = _trials(envs, policy, num_steps, num_envs, seconds, train_seconds, placements, device)
    return dict(best.options)


def _trials(
    envs: Any,
    policy: nn.Module | None,
    num_steps: int,
    num_envs: int | None,
    seconds: float,
    train_seconds: float,
    placements: Sequence[Mapping[str, Any]] | None,
    device: Any,
) -> tuple[list[_Row], _Row]:
    """:func:`tune`'s work, printing as it goes: every placement's row and the fastest one."""
    n = _check_arguments(envs, num_steps, num_envs, seconds, train_seconds)
    candidates = default_placements(n) if placements is None else _check_placements(placements)
    if policy is None:
        policy = _default_policy(envs, n)
    update = _Update(train_seconds) if train_seconds > 0 else None
    setting = _TrialSetting(envs=envs, policy=policy, num_envs=n, num_steps=num_steps, device=device, update=update)
    rows = [_Row(options=dict(options)) for options in candidates]
    print(_header(envs, n, num_steps, policy, device, seconds, train_seconds, len(rows)), flush=True)
    began = perf_counter()
    if not isinstance(envs, VectorEnv):
        # Worker processes start from a fork server that imports torch (seconds): it starts now, while the
        # thread's trials run, rather than in the first trial with worker processes.
        start_workers_early()
    _run_rounds(rows, setting, seconds)
    best = max((row for row in rows if row.stats), key=lambda row: row.median)
    print(_table(rows, best, perf_counter() - began))
    # a Collector of these envs and batch shape leaves what was measured slower out of its verdict
    record_tuned(tuned_key(envs, n, num_steps), _measured_slower(rows, best))
    return rows, best


@dataclass(frozen=True, kw_only=True)
class _TrialSetting:
    """What every trial shares: the user's envs and policy, the batch shape, and the stand-in update."""

    envs: Any
    policy: nn.Module
    num_envs: int
    num_steps: int
    device: torch.device | str | None
    update: _Update | None


@dataclass(kw_only=True)
class _Row:
    """One placement's trials: its keyword arguments, the account of each round, or why the Collector refused it."""

    options: dict[str, Any]
    stats: list[Stats] = field(default_factory=list)
    refused: BaseException | None = None

    @property
    def label(self) -> str:
        return ", ".join(f"{key}={value!r}" for key, value in self.options.items())

    @property
    def median(self) -> float:
        return statistics.median(s.fps for s in self.stats)

    def median_stats(self) -> Stats:
        """The account of the round whose frames per second is the median (the lower one of an even count)."""
        ordered = sorted(self.stats, key=lambda s: s.fps)
        return ordered[(len(ordered) - 1) // 2]


def _run_rounds(rows: list[_Row], setting: _TrialSetting, seconds: float) -> None:
    """``ROUNDS`` rounds of one trial per placement, each timed for an even share of what is left of ``seconds``."""
    timed = 0.0
    for r in range(ROUNDS):
        live = [row for row in rows if row.refused is None]
        window = max(0.0, seconds - timed) / ((ROUNDS - r) * len(live))
        for row in live:
            try:
                collector = _build(row.options, setting)
            except (TypeError, ValueError, RuntimeError) as exc:  # the Collector's refusals, which name the cause
                row.refused = exc
                continue
            with collector:
                stats = _time(collector, setting.update, window)
            row.stats.append(stats)
            timed += stats.seconds
        if not any(row.stats for row in rows):
            raise rows[0].refused or RuntimeError("tune: no placement was tried")


def _build(options: Mapping[str, Any], setting: _TrialSetting) -> Collector:
    return Collector(
        setting.envs,
        setting.policy,
        num_envs=setting.num_envs,
        num_steps=setting.num_steps,
        device=setting.device,
        **options,
    )


def _time(collector: Collector, update: _Update | None, window: float) -> Stats:
    """Warm-up untimed, then batches taken at once (each followed by ``update``) for ``window`` seconds: the account."""
    batches = iter(collector)
    for _ in range(WARMUP_BATCHES):
        next(batches)
        if update is not None:
            update()
    collector.stats(reset=True)
    end = perf_counter() + window
    while True:  # at least one batch, however short the window
        next(batches)
        if update is not None:
            update()
        if perf_counter() >= end:
            return collector.stats()


class _Update:
    """A stand-in for a CPU trainer's update: Adam steps of a 64x64 tanh MLP on fixed data, ``seconds`` per batch."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        with torch.random.fork_rng(devices=[]):  # the caller's random stream stays as it was
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
            self.x, self.y = torch.randn(256, 64), torch.randn(256, 1)  # a minibatch of 256
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=1e-4)

    def __call__(self) -> None:
        end = perf_counter() + self.seconds
        while perf_counter() < end:
            loss = (self.net(self.x) - self.y).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()


class MLPPolicy(nn.Module):
    """A small actor-critic for :func:`tune` without a policy: 64x64 tanh MLPs, Categorical or diagonal Gaussian.

    Args:
        observation_space: one env's :class:`gymnasium.spaces.Box` observations (flattened).
        action_space: one env's :class:`~gymnasium.spaces.Discrete` or :class:`~gymnasium.spaces.Box` actions.

    Examples:
        >>> from gymnasium import spaces
        >>> policy = MLPPolicy(spaces.Box(-1, 1, (4,)), spaces.Discrete(2))
        >>> out = policy(torch.zeros(3, 4))
        >>> out["action"].shape, out["log_prob"].shape, out["value"].shape
        (torch.Size([3]), torch.Size([3]), torch.Size([3]))
    """

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Space, hidden: int = 64) -> None:
        super().__init__()
        if not isinstance(observation_space, spaces.Box):
            raise TypeError(
                f"tune: the default policy takes Box observations, got observation_space {observation_space!r}; "
                "pass your own policy (the command line: --policy module:factory)"
            )
        if isinstance(action_space, spaces.Discrete):
            out = int(action_space.n)
            self.log_std: nn.Parameter | None = None
        elif isinstance(action_space, spaces.Box):
            out = int(torch.Size(action_space.shape).numel())
            self.log_std = nn.Parameter(torch.zeros(out))
        else:
            raise TypeError(
                f"tune: the default policy takes Discrete or Box actions, got action_space {action_space!r}; "
                "pass your own policy (the command line: --policy module:factory)"
            )
        inputs = int(torch.Size(observation_space.shape).numel())
        self.action_shape = tuple(action_space.shape or ())
        self.actor = _mlp(inputs, hidden, out)
        self.critic = _mlp(inputs, hidden, 1)

    def forward(self, obs: Tensor) -> dict[str, Tensor]:
        x = obs.flatten(1).float()  # [n, obs_dim]; uint8 images become floats
        dist = self._dist(self.actor(x))
        action = dist.sample()
        log_prob = dist.log_prob(action)
        if self.log_std is not None:
            action = action.reshape(len(obs), *self.action_shape)
        return {"action": action, "log_prob": log_prob, "value": self.critic(x).squeeze(-1)}

    def _dist(self, out: Tensor) -> Distribution:
        # No argument validation: a trainer's agent skips it too (it costs as much as the network here)
        if self.log_std is None:
            return Categorical(logits=out, validate_args=False)
        return Independent(Normal(out, self.log_std.exp(), validate_args=False), 1, validate_args=False)


def _mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, outputs)
    )


def _default_policy(envs: Any, num_envs: int) -> nn.Module:
    """An :class:`MLPPolicy` for the envs' spaces (built once here, and closed, where ``envs`` is not live)."""
    if isinstance(envs, VectorEnv):
        return MLPPolicy(envs.single_observation_space, envs.single_action_space)
    built = build_envs(envs, num_envs)
    try:
        return MLPPolicy(built.single_observation_space, built.single_action_space)
    finally:
        built.close()


def _check_arguments(envs: Any, num_steps: Any, num_envs: Any, seconds: Any, train_seconds: Any) -> int:
    """Refuses arguments of the wrong type or range, naming the fix; returns the number of envs."""
    check_int("num_steps", num_steps, minimum=1, who="tune")
    if not isinstance(envs, (VectorEnv, str)) and not callable(envs):
        raise TypeError(
            f"tune: envs must be a gymnasium.vector.VectorEnv, an env id str or a function make_envs(num_envs), "
            f"got {type(envs).__name__} {envs!r}"
        )
    num_envs = resolve_num_envs(envs, num_envs, who="tune")
    for name, value, minimum in (("seconds", seconds, "> 0"), ("train_seconds", train_seconds, ">= 0")):
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or not (value > 0 if minimum == "> 0" else value >= 0):
            raise ValueError(f"tune: {name} must be a finite number {minimum} of seconds, got {value!r}")
    return num_envs


def _check_placements(placements: Any) -> list[Mapping[str, Any]]:
    """The user's placements, each a mapping of Collector keyword arguments that tune() does not set itself."""
    example = '[{"backend": "thread", "prefetch": 0}, {"backend": torch_rollout.Processes(num_workers=2)}]'
    if isinstance(placements, (str, Mapping)) or not isinstance(placements, Sequence) or not placements:
        raise TypeError(
            f"tune: placements must be a non-empty list of dicts of Collector keyword arguments, e.g. {example}, "
            f"got {type(placements).__name__} {placements!r}"
        )
    accepted = set(inspect.signature(Collector.__init__).parameters) - {"self", *_FIXED}
    for k, options in enumerate(placements):
        if not isinstance(options, Mapping):
            raise TypeError(
                f"tune: placements[{k}] must be a dict of Collector keyword arguments, e.g. {example}, got "
                f"{type(options).__name__} {options!r}"
            )
        unknown = sorted(str(key) for key in options if key not in accepted)
        if unknown:
            raise ValueError(
                f"tune: placements[{k}] has {unknown}, which are not Collector keyword arguments that a placement "
                f"may set; expected some of {sorted(accepted)} (tune sets {list(_FIXED)} itself)"
            )
    return list(placements)


# -- the report -----------------------------------------------------------------------------------


def _header(
    envs: Any, num_envs: int, num_steps: int, policy: nn.Module, device: Any, seconds: float, train: float, rows: int
) -> str:
    where = device if device is not None else "cuda" if torch.cuda.is_available() else "cpu"
    threads = torch.get_num_threads()
    training = (
        f"after each batch the trainer runs {train} s of Adam steps of a 64x64 MLP (train_seconds={train})"
        if train
        else "no training between batches: frames/s of `for batch in collector` taking each batch at once"
    )
    return (
        f"torch_rollout.tune: envs={envs!r}, num_envs={num_envs}, num_steps={num_steps}, device={where}, policy "
        f"{type(policy).__name__}; {available_cores()} cores, {threads} torch thread{'s' * (threads != 1)} in the "
        f"trainer (torch.get_num_threads())\n"
        f"{rows} placements x {ROUNDS} rounds, interleaved; each trial a fresh Collector, {WARMUP_BATCHES} warm-up "
        f"batches untimed, then about {seconds / (rows * ROUNDS):.2f} s timed; {training}"
    )


def _table(rows: list[_Row], best: _Row, wall: float) -> str:
    first = rows[0].median if rows[0].stats else None
    lines = [
        "| placement | frames/s (median) | min - max | vs first | env | policy | collector | idle | trainer waits |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes: list[str] = []
    for row in rows:
        if row.refused is not None:
            later = f" (refused in a later round, after {len(row.stats)})" if row.stats else ""
            notes.append(f"[{len(notes) + 1}] {row.label}: refused{later}: {type(row.refused).__name__}: {row.refused}")
        if not row.stats:
            lines.append(f"| {row.label} | refused [{len(notes)}] | | | | | | | |")
            continue
        fps = [s.fps for s in row.stats]
        ratio = f"{row.median / first:.2f}x" if first else ""
        shares = _shares(row.stats)
        lines.append(
            f"| {row.label} | {row.median:,.0f} | {min(fps):,.0f} - {max(fps):,.0f} | {ratio} | "
            + " | ".join(f"{100 * shares[key]:.0f}%" for key in ("env", "policy", "collector", "idle", "wait"))
            + " |"
        )
    timed = sum(s.seconds for row in rows for s in row.stats)
    slower = _measured_slower(rows, best)
    lines += [
        "",
        f"best: {best.label} ({best.median:,.0f} frames/s; {timed:.1f} s timed of {wall:.1f} s in all)",
        f"its median round's account: {best.median_stats().describe(slower=slower)}",
        *notes,
    ]
    if slower:
        measured = ", ".join(f"{placement} {ratio:.2f}x" for placement, ratio in slower.items())
        lines.append(f"not advised, measured slower than the best here: {measured}")
    return "\n".join(lines)


def _measured_slower(rows: list[_Row], best: _Row) -> dict[str, float]:
    """Each placement measured slower than ``best`` (as its ``repr``), with its median's ratio to the best's."""
    slower: dict[str, float] = {}
    chosen = repr(best.options.get("backend"))
    for row in rows:
        backend = row.options.get("backend")
        if row.stats and row is not best and isinstance(backend, Backend) and row.median < best.median:
            placement = repr(backend)
            if placement == chosen:  # the best's own placement, with other settings
                continue
            slower[placement] = max(slower.get(placement, 0.0), row.median / best.median)
    return slower


def _shares(stats: list[Stats]) -> dict[str, float]:
    """The loops' shares of their time over all rounds, and the trainer's share of its time waiting in next()."""
    total = {key: sum(getattr(s, key) for s in stats) for key in ("env", "policy", "collector", "idle")}
    loops = sum(total.values()) or 1.0
    shares = {key: value / loops for key, value in total.items()}
    shares["wait"] = sum(s.wait for s in stats) / (sum(s.seconds for s in stats) or 1.0)
    return shares
