"""What the collector's remainder against a hand loop is made of at the short off-policy shapes: its
guarantees and the ring's work, measured by leaving them out.

The ring shapes of ``hand_loops.py`` (gymnasium's CartPole-v1 in SAME_STEP mode at N=4 T=1, N=16 T=1
and N=4 T=8, torch_rollout's torch CartPole at N=4096 T=1; a 64x64 Q-network acting greedily, the
transitions' five keys into a ring): CleanRL's (FastTD3's) hand loop and ``ReplayRing.fill(collector)``
with ``prefetch=0``, as there, beside the same collector with one group of its per-step work replaced by
a stand-in that does only what these envs and this policy need:

- checks: the observations' shape and dtype, the actions' range and conversion for the env, the
  policy's outputs (names, shapes, dtypes), checked at every step; the stand-in passes them on as they
  are;
- totals and rows: the episode totals (``episode_return``, ``episode_length``) kept per env and written
  with ``truncated`` and ``policy_version`` into every row; the stand-in keeps ``reward``,
  ``terminated`` and ``mask`` rows only (the ring keeps none of the others);
- contexts: the Ctrl-C hold around each batch (a first Ctrl-C waits for the batch's end) and the
  thread's own tensordict interaction type; the stand-in enters neither.

and, with all three left out, without the ring's work at the batch's end as well (the collector writes
each row into its own arrays, and the ring copies the keys it keeps from there and writes ``next_obs`` and
``done`` into its storage, where the hand loop writes its ring once, its true next observations patched in
at each step): the ring then holds no rows, so this column only measures.

The stand-ins replace private functions of this version for the run (as ``fixed_cost.py`` wraps them) and
hold only for these envs: they are a measurement, not an option. Systems of a shape run interleaved, each
built afresh per repeat, one torch thread; medians and the collector's rate over the hand loop's.

Usage::

    .venv/bin/python benchmarks/remainder.py [--repeats 5] [--quick]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import offpolicy
import torch

import torch_rollout.placements._thread as thread_placement
from torch_rollout.envs._numpy import NumpyEnvs
from torch_rollout.envs._seam import StepRecord
from torch_rollout.envs._spaces import ActionConverter, ObsChecker
from torch_rollout.envs._torch import TorchEnvs
from torch_rollout.loop._acting import Acting
from torch_rollout.loop._rows import DeviceRows, HostRows
from torch_rollout.replay import ReplayRing
from torch_rollout.util._devices import copy_into

from _common import fmt_rate, interleaved_run, load_line, markdown_table, run_interleaved, write_json

SHAPES = (("gym", 4, 1), ("gym", 16, 1), ("gym", 4, 8), ("torch", 4096, 1))
GROUPS = ("checks", "totals and rows", "contexts")
COLUMNS = (
    "hand loop",
    "collector",
    *(f"without {group}" for group in GROUPS),
    "without all three",
    "without all three and the ring's work",
)


class _NoContext:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info: Any) -> None:
        pass


def _step_into_rows(self: NumpyEnvs, action: torch.Tensor, rows: Any, t: int, action_row: Any = None) -> Any:
    next_obs, reward, terminated, truncated, info = self._step(self.to_env_action(action, None, action_row))
    done = terminated | truncated
    rows["reward"][t] = reward
    rows["terminated"][t] = terminated
    if done.any():
        return self._end_episodes(done, next_obs, info)
    return next_obs, None


def _recv(self: TorchEnvs) -> StepRecord:
    next_obs, reward, terminated, truncated, info = self.envs.step(self.action)
    done = terminated | truncated
    next_obs, final, own = self._finals(self.autoreset_mode, next_obs, info, done)
    return StepRecord(
        obs=next_obs, reward=reward, terminated=terminated, truncated=truncated, done=done, mask=None,
        episode_return=None, episode_length=None, is_init=done, final=final, own_final=own, info=info,
    )  # fmt: skip


def _put_results(self: DeviceRows, index: int, record: StepRecord) -> None:
    copy_into(self.views["reward"][index], record.reward)
    copy_into(self.views["terminated"][index], record.terminated)
    self.filled += self.N


def _put_outputs(self: Any, t: int, out_t: dict[str, Any], version: int, state: Any) -> None:
    self._put_outputs_row(t, out_t)


def _put_plain(self: HostRows, t: int, out_t: dict[str, Any], version: int) -> Any:
    if self.outputs is None:
        self.outputs = self._allocate_outputs(out_t)
    self._put_outputs_row(t, out_t, but="action")
    return self.action_rows[t]  # a NumPy view for these policies


def _actions_unchecked(self: ActionConverter, action: torch.Tensor, env_ids: Any = None, row: Any = None) -> Any:
    array = action.numpy()
    if row is not None:
        row[...] = array
    return array


def _take_without_copy(self: ReplayRing, rows: Any) -> int | None:
    """The ring's position moved on as if the rows were copied in where they could be, and nothing copied."""
    n = rows.num_steps * rows.num_envs
    if self._arrays is None or self.position + n > self.capacity or not rows.every_row:
        return None
    self.position, self.size = (self.position + n) % self.capacity, min(self.size + n, self.capacity)
    return n


_ORIGINAL = {
    (owner, name): getattr(owner, name)
    for owner, name in (
        (ObsChecker, "__call__"),
        (ActionConverter, "__call__"),
        (Acting, "check_outputs"),
        (TorchEnvs, "_check_obs"),
        (TorchEnvs, "_step_tensor"),
        (NumpyEnvs, "step_into_rows"),
        (HostRows, "put_acted"),
        (HostRows, "put_plain"),
        (TorchEnvs, "recv"),
        (DeviceRows, "put_results"),
        (DeviceRows, "put_acted"),
        (thread_placement, "_HeldInterrupt"),
        (thread_placement, "own_interaction_type"),
        (ReplayRing, "_take"),
    )
}
_check_outputs = _ORIGINAL[Acting, "check_outputs"]


def _outputs_as_they_are(self: Acting, raw: Any, n: int) -> Any:
    return raw if self.layout is not None else _check_outputs(self, raw, n)  # the first call learns the layout


_STAND_INS: dict[str, dict[tuple[Any, str], Any]] = {
    "checks": {
        (ObsChecker, "__call__"): lambda self, obs, call: None,
        (ActionConverter, "__call__"): _actions_unchecked,
        (Acting, "check_outputs"): _outputs_as_they_are,
        (TorchEnvs, "_check_obs"): lambda self, obs, call: obs,
        (TorchEnvs, "_step_tensor"): lambda self, value, what, dtype: value,
    },
    "totals and rows": {
        (NumpyEnvs, "step_into_rows"): _step_into_rows,
        (HostRows, "put_acted"): _put_outputs,
        (HostRows, "put_plain"): _put_plain,
        (TorchEnvs, "recv"): _recv,
        (DeviceRows, "put_results"): _put_results,
        (DeviceRows, "put_acted"): _put_outputs,
    },
    "contexts": {
        (thread_placement, "_HeldInterrupt"): _NoContext,
        (thread_placement, "own_interaction_type"): _NoContext,
    },
    "the ring's work": {(ReplayRing, "_take"): _take_without_copy},
}


def _replace(groups: tuple[str, ...]) -> None:
    """This version's functions, with the stand-ins of ``groups``."""
    for (owner, name), original in _ORIGINAL.items():
        setattr(owner, name, original)
    for group in groups:
        for (owner, name), stand_in in _STAND_INS[group].items():
            setattr(owner, name, stand_in)


def _system(shape: Any, groups: tuple[str, ...] | None) -> Callable[[], Any]:
    def build() -> Any:
        _replace(groups or ())
        return offpolicy.hand_loop(shape) if groups is None else offpolicy.Filling(shape)

    return build


def run(repeats: int, quick: bool) -> list[dict[str, Any]]:
    results = []
    for kind, num_envs, num_steps in SHAPES[:1] if quick else SHAPES:
        shape = offpolicy._Shape(kind, num_envs, num_steps, torch.device("cpu"))
        groups: list[tuple[str, ...] | None] = [
            None,
            (),
            *((group,) for group in GROUPS),
            GROUPS,
            (*GROUPS, "the ring's work"),
        ]
        name = offpolicy.shape_name(kind, num_envs, num_steps)
        print(name)
        try:
            rates = run_interleaved(
                {column: _system(shape, g) for column, g in zip(COLUMNS, groups)},
                repeats=repeats,
                warmup=1,
                steps=2 if quick else max(16, 400 // shape.batches),  # 16,384 frames or more, 400 batches or more
            )
        finally:
            _replace(())
        results.append({"shape": name, "rates": rates})
    return results


def to_markdown(results: list[dict[str, Any]]) -> str:
    rows = []
    for result in results:
        rates = result["rates"]
        hand = statistics.median(rates["hand loop"])
        cells = []
        for column in COLUMNS:
            rate = statistics.median(rates[column])
            cells.append(fmt_rate(rate) if column == "hand loop" else f"{fmt_rate(rate)} ({rate / hand:.2f}x)")
        rows.append([result["shape"], *cells])
    return markdown_table(["shape", *COLUMNS], rows)


def main() -> None:
    repeats, quick, started, info = interleaved_run(__doc__, default_repeats=5, quick="the first shape")
    results = run(repeats, quick)
    table = to_markdown(results)
    print(
        f"\n{table}\n\n({repeats} repeats, one torch thread, frames/s and collector / hand loop; {load_line(started)})"
    )
    if not quick:
        write_json("remainder", {"machine": info, "repeats": repeats, "results": results, "table": table})


if __name__ == "__main__":
    main()
