"""Where a collector's time goes: the loop's account of its phases, and the :class:`Stats` that the trainer reads.

Every collection loop keeps an :class:`Account` of its own seconds: stepping
the envs, in the policy's forward, its own work (rows, bootstraps, infos), and
idle between batches (waiting for the trainer to ask for the next one). The
clock is read around each env call and each forward, a few reads per step.
Worker processes and Ray actors send their account with each batch; the
trainer's side adds what it spends in ``next()``: waiting for the batch, and
the collector's work there (the weight refresh, GAE). :meth:`Collector.stats`
puts them together as :class:`Stats`, over the time since the collector was
built or the account was last reset.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from time import perf_counter
from typing import NamedTuple

__all__ = [
    "NO_TOTALS",
    "Account",
    "Setting",
    "Stats",
    "Totals",
    "WorkerStats",
    "record_tuned",
    "tuned_key",
    "tuned_slower",
]


class Totals(NamedTuple):
    """One loop's account so far, as a worker sends it with each batch: seconds, then counts."""

    env: float  # in the driver's env calls
    policy: float  # in the policy's forward
    work: float  # the loop's own work: its busy time less env and policy
    idle: float  # between batches
    batches: int
    frames: int

    def __sub__(self, earlier: Totals) -> Totals:
        """What was added since ``earlier``, field by field."""
        return Totals(
            self.env - earlier.env,
            self.policy - earlier.policy,
            self.work - earlier.work,
            self.idle - earlier.idle,
            self.batches - earlier.batches,
            self.frames - earlier.frames,
        )


NO_TOTALS = Totals(0.0, 0.0, 0.0, 0.0, 0, 0)


class Account:
    """One collection loop's running totals, in seconds (``perf_counter``) and frames; only ever grows."""

    __slots__ = ("batches", "busy", "env", "frames", "idle", "policy", "since")

    def __init__(self) -> None:
        self.env = 0.0  # inside the env's own calls (reset, step, send, recv), as the driver times them
        self.policy = 0.0  # in the placement's forward: acting, and the bootstrap values of final observations
        self.busy = 0.0  # inside collect(): env + policy + the loop's own work
        self.idle = 0.0  # between the end of one collect() and the start of the next
        self.batches = 0
        self.frames = 0
        self.since: float | None = None  # when the last collect() ended; None inside one and before the first

    def begin(self, now: float) -> None:
        """A collect() begins at ``now``: the time since the last one ended was idle."""
        if self.since is not None:
            self.idle += now - self.since
            self.since = None

    def end(self, began: float, now: float, env: float, policy: float, frames: int) -> None:
        """A collect() that began at ``began`` ends at ``now`` with ``frames`` more; ``env`` and ``policy``: the
        driver's and the acting side's running totals."""
        self.env, self.policy = env, policy
        self.busy += now - began
        self.batches += 1
        self.frames += frames
        self.since = now

    def totals(self, now: float | None = None) -> Totals:
        """Its totals so far; with ``now``, idle counts up to it."""
        idle = self.idle
        if now is not None and self.since is not None:
            idle += max(0.0, now - self.since)
        return Totals(self.env, self.policy, self.busy - self.env - self.policy, idle, self.batches, self.frames)


@dataclass(frozen=True)
class WorkerStats:
    """One collection loop's seconds (the thread's, or one worker process's or Ray actor's).

    ``env``: stepping its envs; ``policy``: its policy's forward (acting and
    bootstrap values); ``collector``: its own work (rows, final observations,
    infos, episode totals); ``idle``: waiting for the trainer to ask for a
    batch (in lockstep: the trainer's time between ``next()`` calls).
    """

    env: float
    policy: float
    collector: float
    idle: float
    frames: int

    @property
    def seconds(self) -> float:
        """Its accounted time: ``env + policy + collector + idle``."""
        return self.env + self.policy + self.collector + self.idle


@dataclass(frozen=True)
class Setting:
    """What the verdict needs to know of the collector: where it runs and the settings that cost time."""

    backend: str
    num_workers: int
    num_envs: int
    num_steps: int
    prefetch: int
    device: str
    live_envs: bool  # a VectorEnv given as it is: it cannot move to worker processes
    check_finite: bool
    info_keys: int
    cores: int
    gpus: int
    # torch's intra-op threads where the policy acts (the trainer's for the thread, 1 in a worker): the cores its
    # forward already uses
    threads: int = 1


def available_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# The verdict's thresholds: below this share of its time waiting in next(), the trainer bounds the run.
_TRAINER_BOUND = 0.10
# A trainer-bound run on the collector's thread is pointed to a worker process when the thread was busy at least
# this share of the time (SAC on Pendulum with 4 envs: 8%, and 0.94x a hand-written loop against 1.01x in a
# worker process, benchmarks/sac_e2e.py)
_GIL_SHARE = 0.03
_SHARE_KEYS = ("env", "policy", "collector")
_PHASES = {"env": "env steps", "policy": "the policy's forward", "collector": "the collector's own work"}
# Worker processes split the envs, not the steps: each calls the policy and steps its envs as often as one loop
# does, on fewer rows. What a call costs whatever its rows is not divided among them: a 64x64 actor-critic's
# forward took 140-170 us on 1 to 64 rows (237 us on 256), one torch thread, on the 2-core machine. The verdict
# counts this much of each call of the bounding phase as that fixed part, and offers workers only where they would
# still gain _WORKERS_GAIN (tune measured Processes(num_workers=2) at 0.86x-0.90x the thread where a call of the
# bounding phase took about 180 us).
_PER_CALL = 200e-6
_WORKERS_GAIN = 1.25


@dataclass(frozen=True)
class Stats:
    """A collector's account of its time since it was built or last reset: ``collector.stats()``.

    Attributes:
        seconds: wall-clock time of the account.
        frames: env steps delivered (``num_steps * num_envs`` per batch).
        batches: batches delivered.
        env, policy, collector, idle: the collection loops' seconds, summed over workers: stepping the envs, the
            policy's forward, the collector's own work (rows, bootstraps, infos, and in the trainer's thread the
            weight refresh and GAE), and waiting for the trainer to ask for a batch.
        wait: seconds the trainer waited in ``next()`` for a batch (in lockstep: collecting it).
        workers: each loop's :class:`WorkerStats`, in worker order (one for the thread); a worker's
            account counts up to its last batch.
        setting: the collector's placement and settings, for :meth:`verdict`.
        tuned_slower: the placements (as their ``repr``) that :func:`torch_rollout.tune` measured slower than its
            best in this process, for these envs and this batch shape; the verdict does not offer them.

    ``str(stats)`` is one line: frames per second, the loops' shares of their
    time, the trainer's share spent waiting, and the verdict. Stats pickle.
    """

    seconds: float
    frames: int
    batches: int
    env: float
    policy: float
    collector: float
    idle: float
    wait: float
    workers: tuple[WorkerStats, ...]
    setting: Setting
    tuned_slower: tuple[str, ...] = ()

    @property
    def fps(self) -> float:
        """Frames (env steps) delivered per second."""
        return self.frames / self.seconds if self.seconds > 0 else 0.0

    @property
    def training(self) -> float:
        """The trainer's seconds outside the collector: ``seconds`` less ``wait`` and its collector work there."""
        return max(0.0, self.seconds - self.wait - self._trainer_work)

    @property
    def _trainer_work(self) -> float:
        return max(0.0, self.collector - sum(w.collector for w in self.workers))

    def shares(self) -> dict[str, float]:
        """The loops' shares of their accounted time: ``env``, ``policy``, ``collector``, ``idle`` (summing to 1)."""
        total = self.env + self.policy + self.collector + self.idle
        if total <= 0:
            return dict.fromkeys(("env", "policy", "collector", "idle"), 0.0)
        return {key: getattr(self, key) / total for key in ("env", "policy", "collector", "idle")}

    def verdict(self, *, slower: Collection[str] = ()) -> str:
        """What bounds the run, measured by this account, and the change that would help (or that none would).

        Each lever says what it expects and why. ``slower``: placements (as their ``repr``, e.g.
        ``"Processes(num_workers=2)"``) measured slower than this run's on this machine, which it does not offer;
        it leaves out those of ``tuned_slower`` too.
        """
        slower = (*slower, *self.tuned_slower)
        if self.batches == 0 or self.seconds <= 0:
            return "no batch delivered yet: nothing to judge"
        waiting = self.wait / self.seconds
        if waiting < _TRAINER_BOUND:
            found = (
                f"training bounds the run: the trainer waited for batches {_pct(waiting)} of the time, so faster "
                "collection (more envs or workers) would gain at most that; make the update faster"
            )
            gil = self._gil_lever()
            return found + ("" if any(placement in gil for placement in slower) else gil)
        busy = {key: getattr(self, key) for key in _SHARE_KEYS}
        collecting = sum(busy.values())
        if collecting <= 0:
            return f"the trainer waited {_pct(waiting)} of the time, with no collection accounted"
        top = max(busy, key=lambda key: busy[key])
        found = (
            f"collection bounds the run (the trainer waited {_pct(waiting)} of the time; {_PHASES[top]} took "
            f"{_pct(busy[top] / collecting)} of the collection's busy time)"
        )
        more, note = self._workers_lever(top)
        phase = self._phase_levers(top)
        # Where the policy bounds the run, its own levers come first: workers add cores only beyond its threads.
        levers = [lever for lever in ((*phase, more) if top == "policy" else (more, *phase)) if lever]
        levers = [lever for lever in levers if not any(placement in lever for placement in slower)]
        if not levers:
            return f"{found}: none of the collector's settings is to blame; please report it with this line"
        return f"{found}: try " + "; or ".join(levers) + (f" ({note})" if note else "")

    def _gil_lever(self) -> str:
        """For a trainer-bound run on the collector's thread: the thread's Python takes turns on the GIL with the
        trainer's (an update of many small ops waits at each of them), so a worker process can make the update
        itself faster, by the thread's busy share at most."""
        s = self.setting
        busy = (self.env + self.policy + sum(w.collector for w in self.workers)) / self.seconds
        if s.backend != "thread" or s.prefetch < 1 or s.live_envs or s.cores < 2 or busy < _GIL_SHARE:
            return ""
        return (
            f"; the collector's thread was busy {_pct(busy)} of the time in this process, taking turns on the GIL "
            "with the update: backend=torch_rollout.Processes(num_workers=1) collects beside it in a process of "
            "its own"
        )

    def _workers_lever(self, top: str) -> tuple[str | None, str | None]:
        """More worker processes (or Ray actors) where free cores allow (every phase of the loop runs in each, on
        one core); else why not.

        The cores counted: the trainer keeps one when it trains much of the time; a policy-bound run's forward
        already runs on its torch threads, so workers add to it only past them.
        """
        s = self.setting
        training = self.training / self.seconds
        usable = min(s.num_envs, s.cores if training < 0.25 else s.cores - 1)
        workers = s.num_workers if s.backend in ("process", "ray") else 0
        if usable <= workers or s.cores < 2:
            note = f"not more workers: {workers} already use the {s.cores} cores this process may run on"
            return None, note if workers else None
        # The cores the bounding phase has now: a worker's one each; on the thread, the forward's torch threads,
        # and one for everything else
        in_use = workers or (s.threads if top == "policy" else 1)
        if top == "policy" and usable <= in_use:
            return None, (
                f"not worker processes: the policy's forward already runs on {in_use} of the {s.cores} cores "
                f"(torch threads), and {usable} workers would split those cores, not add to them"
            )
        call, gain = self._split_gain(top, usable)
        if gain < _WORKERS_GAIN:
            return None, (
                f"not more worker processes: each takes every step, on its share of the envs, and {_PHASES[top]} "
                f"took {call * 1e6:,.0f} us a step, mostly a cost per call that each worker pays in full"
            )
        if s.live_envs:
            lever = (
                "a function make_envs(num_envs) instead of the live vector env, to collect in worker processes "
                f"(backend=torch_rollout.Processes(num_workers={usable}); {s.cores} cores here)"
            )
        elif s.backend == "ray":
            lever = f"more Ray actors: backend=torch_rollout.Ray(num_workers={usable}) ({s.cores} cores here)"
        else:
            lever = f"backend=torch_rollout.Processes(num_workers={usable}) ({s.cores} cores here)"
        # What it can gain: the phase that bounds the run, on usable cores instead of the ones it has now
        expects = f"{_PHASES[top]} on {usable} cores instead of {in_use}, about {gain:.1f}x as fast"
        return f"{lever[:-1]}: expects {expects})", None

    def _split_gain(self, top: str, usable: int) -> tuple[float, float]:
        """The bounding phase's seconds per step in one loop, and the rate that ``usable`` loops would expect where
        each step keeps the fixed part of its cost (``_PER_CALL``) and divides the rest among them."""
        loops = max(self.setting.num_workers if self.setting.backend in ("process", "ray") else 1, 1)
        steps = loops * self.frames / max(self.setting.num_envs, 1)  # the loops' steps, each on its share of envs
        call = getattr(self, top) / steps if steps > 0 else 0.0
        fixed = min(call, _PER_CALL)
        split = fixed + (call - fixed) * loops / usable
        return call, call / split if split > 0 else 1.0

    def _phase_levers(self, top: str) -> list[str]:
        s = self.setting
        if top == "env":
            levers = ["a faster env (a vectorized implementation, fewer wrappers)"]
            if s.live_envs and s.device != "cpu" and s.backend == "thread" and s.prefetch == 0:
                levers.insert(0, "prefetch=1, to step a GPU simulator beside training")
            return levers
        if top == "policy":
            levers = ["compile_policy=True (torch.compile)"]
            if s.device == "cpu" and s.gpus:
                levers.append("device='cuda' for a large network")
            return levers
        levers = []
        if s.num_steps <= 4:
            levers.append(f"more steps per batch (num_steps={s.num_steps}: each batch's fixed work is spread thin)")
        if s.check_finite:
            levers.append("check_finite=False")
        if s.info_keys:
            levers.append(f"fewer info keys (BatchKeys(info_keys=...) records {s.info_keys})")
        return levers

    def __sub__(self, earlier: Stats) -> Stats:
        """The account between ``earlier`` (a ``stats()`` of the same collector, taken before) and this one.

        For a log row per interval while ``collector.stats()`` keeps counting the whole run.
        """
        if not isinstance(earlier, Stats):
            return NotImplemented
        if earlier.setting != self.setting or earlier.seconds > self.seconds:
            raise ValueError(
                "Stats: later - earlier needs an earlier stats() of the same collector, with no reset between; got "
                f"one over {earlier.seconds:.3f} s subtracted from one over {self.seconds:.3f} s"
                + ("" if earlier.setting == self.setting else ", of another collector's settings")
            )
        workers = tuple(
            WorkerStats(
                env=w.env - e.env,
                policy=w.policy - e.policy,
                collector=w.collector - e.collector,
                idle=w.idle - e.idle,
                frames=w.frames - e.frames,
            )
            if w.frames >= e.frames
            else w  # a restarted Ray actor: its account began anew after the earlier one
            for w, e in zip(self.workers, earlier.workers)
        )
        return Stats(
            seconds=self.seconds - earlier.seconds,
            frames=self.frames - earlier.frames,
            batches=self.batches - earlier.batches,
            env=sum(w.env for w in workers),
            policy=sum(w.policy for w in workers),
            collector=sum(w.collector for w in workers) + self._trainer_work - earlier._trainer_work,
            idle=sum(w.idle for w in workers),
            wait=self.wait - earlier.wait,
            workers=workers,
            setting=self.setting,
            tuned_slower=self.tuned_slower,
        )

    def __str__(self) -> str:
        return self.describe()

    def describe(self, *, slower: Collection[str] = ()) -> str:
        """``str(stats)``: the one line of frames per second, shares and the verdict (``verdict(slower=...)``)."""
        shares = self.shares()
        loops = ", ".join(f"{key} {_pct(value)}" for key, value in shares.items())
        waiting = self.wait / self.seconds if self.seconds > 0 else 0.0
        return (
            f"{self.fps:,.0f} frames/s over {self.seconds:.1f} s | collection: {loops} | trainer waits "
            f"{_pct(waiting)} | {self.verdict(slower=slower)}"
        )


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


class StatsClock:
    """The Collector's side of the account: the trainer's waits and work in ``next()``, and the baseline of a reset."""

    def __init__(self) -> None:
        self.wait = 0.0  # in the placement's wait()
        self.work = 0.0  # the collector's work in the trainer's thread: weight refresh, GAE
        self.delivered = 0  # batches delivered
        self.start = perf_counter()
        self.baseline: tuple[float, float, int, list[Totals]] = (0.0, 0.0, 0, [])

    def reset(self, workers: list[Totals]) -> None:
        self.start = perf_counter()
        self.baseline = (self.wait, self.work, self.delivered, workers)

    def stats(
        self, workers: list[Totals], *, frames_per_batch: int, setting: Setting, tuned: tuple[str, ...] = ()
    ) -> Stats:
        wait0, work0, delivered0, base = self.baseline
        per_worker = []
        for k, totals in enumerate(workers):
            before = base[k] if k < len(base) else None
            if before is not None and totals.batches < before.batches:  # a restarted worker (Ray): begun anew
                before = None
            delta = totals if before is None else totals - before
            per_worker.append(
                WorkerStats(
                    env=delta.env,
                    policy=delta.policy,
                    collector=max(0.0, delta.work),
                    idle=delta.idle,
                    frames=int(delta.frames),
                )
            )
        batches = self.delivered - delivered0
        return Stats(
            seconds=perf_counter() - self.start,
            frames=batches * frames_per_batch,
            batches=batches,
            env=sum(w.env for w in per_worker),
            policy=sum(w.policy for w in per_worker),
            collector=sum(w.collector for w in per_worker) + (self.work - work0),
            idle=sum(w.idle for w in per_worker),
            wait=self.wait - wait0,
            workers=tuple(per_worker),
            setting=setting,
            tuned_slower=tuned,
        )


# What tune() measured slower than its best in this process, per envs and batch shape: a collector of the same envs
# and shape leaves those placements out of its verdict. The verdict's worker lever is an expectation from the
# account (the bounding phase on more cores); what a worker process costs besides (its hand-off of each batch, its
# share of the cores with the trainer) only a measurement on the machine tells.
_TUNED_SLOWER: dict[tuple[str, int, int], frozenset[str]] = {}


def tuned_key(envs: object, num_envs: int, num_steps: int) -> tuple[str, int, int]:
    """The envs (an env id, the function that makes them, or a live env's class and id) and the batch shape."""
    if isinstance(envs, str):
        name = envs
    else:
        made_by = envs.func if isinstance(envs, functools.partial) else envs
        spec = getattr(envs, "spec", None)
        name = f"{getattr(made_by, '__module__', '')}.{getattr(made_by, '__qualname__', type(made_by).__qualname__)}"
        if spec is not None and getattr(spec, "id", None):
            name += f"[{spec.id}]"
    return name, int(num_envs), int(num_steps)


def record_tuned(key: tuple[str, int, int], slower: Iterable[str]) -> None:
    """tune()'s measurement for ``key``: the placements slower than its best (replacing an earlier one's)."""
    _TUNED_SLOWER[key] = frozenset(slower)


def tuned_slower(key: tuple[str, int, int]) -> tuple[str, ...]:
    """The placements tune() last measured slower for ``key`` in this process, sorted; none when it did not run."""
    return tuple(sorted(_TUNED_SLOWER.get(key, ())))
