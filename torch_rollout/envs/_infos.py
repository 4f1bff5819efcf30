"""Env infos in the batch: the values of named info keys per row, with a presence mask, aligned with the row's step.

Two recorders with one interface, one per kind of step record: :class:`InfoRecorder`
writes NumPy infos into host rows, :class:`TensorInfoRecorder` tensor infos into rows
on the device. Both learn each key's structure once (``learn``, from the first reset's and
step's infos), then allocate ``[T, N]`` rows (``empty_rows(T, device)``) and write a
step's infos into row ``t`` (``record``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Union

import numpy as np
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from torch_rollout.envs._spaces import where_rows
from torch_rollout.util._devices import to_device

__all__ = ["EPISODE_STATISTICS", "InfoRecorder", "TensorInfoRecorder", "check_info_keys"]

# The structure of gymnasium's RecordEpisodeStatistics "episode" info (return, length, seconds) for one env,
# assumed for an "episode" key that neither the first reset nor the first step gives: it appears at episode
# ends only, and worker processes allocate their batch slots from the first batch.
EPISODE_STATISTICS: dict[str, Any] = {"r": 0.0, "l": 0, "t": 0.0}

# Keys of gymnasium's autoreset machinery, not infos of the env.
_RESERVED = ("final_info", "final_obs")

# One info's structure: a leaf (shape per env, storage dtype) or a dict of sub-structures.
Structure = Union["tuple[tuple[int, ...], np.dtype]", "dict[str, Structure]"]
Path = tuple


def check_info_keys(info_keys: Any) -> dict[str, Any] | None:
    """Validates ``Collector(info_keys=...)``: returns ``{key: example value or None}``, or None for no infos.

    Raises:
        TypeError: ``info_keys`` is not a sequence of str or a mapping of str to example values.
        ValueError: a key is empty, repeated, starts with ``_`` or is one of gymnasium's autoreset keys.
    """
    if info_keys is None:
        return None
    if isinstance(info_keys, str) or not isinstance(info_keys, (Mapping, Iterable)):
        hint = f"; write info_keys=({info_keys!r},)" if isinstance(info_keys, str) else ""
        raise TypeError(
            "Collector: info_keys must be a sequence of info key names or a mapping {key: example value of one "
            f"env, or None}}, got {type(info_keys).__name__} {info_keys!r}{hint}"
        )
    keys = list(info_keys)
    specs = dict(info_keys) if isinstance(info_keys, Mapping) else dict.fromkeys(keys)
    if len(specs) != len(keys):
        raise ValueError(f"Collector: info_keys names a key twice: {keys!r}")
    for key, example in specs.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"Collector: info_keys must be non-empty str names, got {key!r} in {keys!r}")
        if key.startswith("_") or key in _RESERVED:
            raise ValueError(
                f"Collector: info_keys cannot name {key!r}: keys starting with '_' are gymnasium's presence masks "
                "(the batch stores the mask of each kept key itself) and 'final_info'/'final_obs' belong to "
                "its autoreset (the collector reads the final step's infos from there)"
            )
        if example is not None:
            _structure_of_example(example, key)  # raises on what cannot be stored
    return specs


def _storage_dtype(dtype: np.dtype, name: str, what: str) -> np.dtype:
    """The dtype a leaf is stored in: float64 as float32 (as observations), bools and integers kept."""
    if dtype.kind not in "biuf":
        raise TypeError(
            f"Collector: info {name!r} {what} of dtype {dtype}; the batch keeps numbers, booleans and arrays of "
            "them (or dicts of these): leave this key out of info_keys, or convert it in a wrapper"
        )
    return np.dtype(np.float32) if dtype == np.float64 else dtype


def _structure_of_example(example: Any, name: str) -> Structure:
    """The structure of an example value of one env (``0.0``, ``False``, ``np.zeros(3)``, a dict of these)."""
    if isinstance(example, Mapping):
        if not example:
            raise ValueError(f"Collector: info_keys example of {name!r} is an empty dict")
        return {str(sub): _structure_of_example(value, f"{name}.{sub}") for sub, value in example.items()}
    array = np.asarray(example)
    return array.shape, _storage_dtype(array.dtype, name, f"example {example!r} is")


def _structure_of_vector(value: Any, name: str, num_envs: int) -> Structure:
    """The structure of a vector env's info value: ``[num_envs, ...]`` arrays, or a dict of them."""
    if isinstance(value, Mapping):
        return {
            sub: _structure_of_vector(item, f"{name}.{sub}", num_envs)
            for sub, item in value.items()
            if not (sub.startswith("_") and sub[1:] in value)  # gymnasium's masks of nested keys
        }
    array = np.asarray(value)
    if array.dtype == object:
        kinds = sorted({type(item).__name__ for item in array.ravel() if item is not None}) or ["None"]
        raise TypeError(
            f"Collector: info {name!r} holds {'/'.join(kinds)} values (a NumPy object array); the batch keeps "
            "numbers, booleans and arrays of them (or dicts of these): leave this key out of info_keys, or "
            "convert it in a wrapper"
        )
    if array.ndim == 0 or array.shape[0] != num_envs:
        raise ValueError(
            f"Collector: info {name!r} has shape {array.shape}, expected a leading size of {num_envs} "
            "(one row per env, as gymnasium's vector envs give infos)"
        )
    return array.shape[1:], _storage_dtype(array.dtype, name, "is")


def _leaves(structure: Structure, path: Path) -> list[tuple[Path, tuple[int, ...], np.dtype]]:
    if isinstance(structure, dict):
        return [leaf for sub, item in structure.items() for leaf in _leaves(item, (*path, sub))]
    return [(path, *structure)]


def _describe(structure: Structure) -> str:
    if isinstance(structure, dict):
        return "{" + ", ".join(f"{sub!r}: {_describe(item)}" for sub, item in structure.items()) + "}"
    shape, dtype = structure
    return f"{dtype}{list(shape) if shape else ''}"


class InfoRecorder:
    """Writes the named infos of each step into host rows ``[T, N, ...]``, with a presence mask per key.

    The structure of each key (nested dicts, shapes per env, dtypes) is fixed
    when collection starts, so that every batch holds every key: from the
    example value the user gave, else from the infos of the first
    ``envs.reset()`` and ``envs.step()``, else (for ``"episode"``) from
    :data:`EPISODE_STATISTICS`. A key that then has no structure, or whose
    structure later changes, raises ``ValueError`` naming it.

    Which infos belong to a row (the step ``t`` that produced it):

    - NEXT_STEP: the infos ``envs.step()`` returned; on the reset row of an env
      (``mask=False``) they are those of its reset and are masked out.
    - SAME_STEP: for an env that ended, ``infos["final_info"]`` (the step's own
      infos; the top level holds those of the reset), and the top level for a
      key that ``final_info`` lacks for that env (where vector wrappers such as
      ``gymnasium.wrappers.vector.RecordEpisodeStatistics`` put theirs).
    - DISABLED: the infos ``envs.step()`` returned; the infos of the
      collector's ``reset_mask`` resets belong to no row.

    Args:
        specs: ``{key: example value of one env or None}`` (see :func:`check_info_keys`).
        num_envs: envs of the vector env (``N``).
        autoreset_mode: the vector env's autoreset mode.
        env_offset: global index of env 0, for error messages.
    """

    def __init__(
        self, specs: Mapping[str, Any], *, num_envs: int, autoreset_mode: AutoresetMode, env_offset: int = 0
    ) -> None:
        self.specs = dict(specs)
        self.num_envs = num_envs
        self.autoreset_mode = autoreset_mode
        self.env_offset = env_offset
        self.structures: dict[str, Structure] | None = None
        self.leaves: list[tuple[Path, tuple[int, ...], np.dtype]] = []

    def learn(self, reset_infos: Mapping[str, Any], step_infos: Mapping[str, Any]) -> None:
        """Fixes the structure of every key from the examples and the first reset's and step's infos."""
        structures: dict[str, Structure] = {}
        final = step_infos.get("final_info")
        for key, example in self.specs.items():
            if example is not None:
                structures[key] = _structure_of_example(example, key)
                continue
            for infos in (step_infos, final, reset_infos):
                if isinstance(infos, Mapping) and key in infos:
                    structures[key] = _structure_of_vector(infos[key], key, self.num_envs)
                    break
            else:
                if key != "episode":
                    seen = {*step_infos, *(final or {}), *reset_infos}
                    given = sorted(k for k in seen if not k.startswith("_") and k not in _RESERVED)
                    first = self.env_offset
                    raise ValueError(
                        f"Collector: info_keys names {key!r}, but the infos of envs "
                        f"{first}..{first + self.num_envs - 1} "
                        f"have no {key!r} at their first reset and first step (their keys: {given}); for an info "
                        "that appears later (at episode ends, say) give its structure as an example value of one "
                        f"env: info_keys={{{key!r}: 0.0}} (or False, np.zeros(3), {{'a': 0, 'b': 0.0}})"
                    )
                structures[key] = _structure_of_example(EPISODE_STATISTICS, key)
        self.structures = structures
        self.leaves = [leaf for key, structure in structures.items() for leaf in _leaves(structure, (key,))]
        self.leaves += [(("_" + key,), (), np.dtype(np.bool_)) for key in structures]

    # -- storage -------------------------------------------------------------------------------

    def empty_rows(self, T: int, device: torch.device | None = None) -> dict[Path, np.ndarray]:
        """New host rows ``[T, N, ...]`` for every leaf and mask (NumPy whatever ``device``: see :meth:`tensordict`)."""
        return {path: np.empty((T, self.num_envs, *shape), dtype=dtype) for path, shape, dtype in self.leaves}

    @staticmethod
    def views(info: TensorDict) -> dict[Path, np.ndarray]:
        """NumPy views of a batch's ``info`` entry on the host (e.g. a shared-memory slot)."""
        return {key if isinstance(key, tuple) else (key,): info.get(key).numpy() for key in info.keys(True, True)}

    def tensordict(self, rows: Mapping[Path, np.ndarray], batch_size: list[int], device: torch.device) -> TensorDict:
        """The batch's ``info`` entry from host rows."""
        info = TensorDict({}, batch_size=batch_size, device=device)
        for path, array in rows.items():
            info.set(path, to_device(torch.from_numpy(array), device))
        return info

    # -- one step ------------------------------------------------------------------------------

    def record(
        self,
        rows: Mapping[Path, np.ndarray],
        t: int,
        infos: Mapping[str, Any],
        done: np.ndarray,
        mask: np.ndarray | None,
    ) -> None:
        """Writes row ``t`` from the infos of step ``t``; ``mask`` is False on NEXT_STEP reset rows."""
        n = self.num_envs
        same_step = self.autoreset_mode == AutoresetMode.SAME_STEP
        final = infos.get("final_info") if same_step and np.count_nonzero(done) else None
        assert self.structures is not None  # learnt before any row records one
        for key, structure in self.structures.items():
            top = _presence(infos, key, n)
            ended = np.zeros(n, dtype=bool)
            if isinstance(final, Mapping):
                ended = done & _presence(infos, "final_info", n) & _presence(final, key, n)
                top &= ~ended
            if mask is not None:
                top &= mask
            present = rows[("_" + key,)][t]
            np.logical_or(top, ended, out=present)
            for source, where in ((infos, top), (final, ended)):
                if np.count_nonzero(where) and source is not None:  # final is None only where no row ended
                    self._check(source[key], structure, key, where)
            self._write(rows, (key,), structure, t, [(infos, top), (final, ended)])

    def _write(self, rows: Mapping[Path, np.ndarray], path: Path, structure: Structure, t: int, sources: list) -> None:
        if isinstance(structure, dict):
            for sub, item in structure.items():
                self._write(rows, (*path, sub), item, t, sources)
            return
        row = rows[path][t]
        row.fill(0)
        for source, where in sources:
            if np.count_nonzero(where):
                value = source
                for part in path:
                    value = value[part]
                row[where] = np.asarray(value)[where]

    def _check(self, value: Any, structure: Structure, name: str, where: np.ndarray) -> None:
        """Raises ValueError when ``value`` does not have the structure fixed at the start."""
        if isinstance(structure, dict):
            subs = (
                None
                if not isinstance(value, Mapping)
                else {k for k in value if not (k.startswith("_") and k[1:] in value)}
            )
            if subs is None or subs != structure.keys():
                self._changed(name, structure, value, where)
            for sub, item in structure.items():
                self._check(value[sub], item, f"{name}.{sub}", where)
            return
        shape, dtype = structure
        array = None if isinstance(value, Mapping) else np.asarray(value)
        if array is None or array.shape != (self.num_envs, *shape) or not np.can_cast(array.dtype, dtype, "same_kind"):
            self._changed(name, structure, value, where)

    def _changed(self, name: str, structure: Structure, value: Any, where: np.ndarray) -> None:
        env = self.env_offset + int(np.flatnonzero(where)[0])
        if isinstance(value, Mapping):
            got = "a dict with keys " + repr(sorted(k for k in value if not (k.startswith("_") and k[1:] in value)))
        else:
            array = np.asarray(value)
            got = f"dtype {array.dtype}{list(array.shape[1:]) if array.ndim > 1 else ''}"
        raise ValueError(
            f"Collector: envs.step() returned info {name!r} for env {env} as {got}, but its structure was fixed "
            f"as {_describe(structure)} when collection started (from the info_keys example, or the first "
            "reset and step); an info must keep its keys, shape and kind of dtype: give the structure it has "
            "at its first appearance as an example value in info_keys"
        )


def _presence(infos: Mapping[str, Any], key: str, num_envs: int) -> np.ndarray:
    """Which envs gave ``key`` (gymnasium's ``_key`` mask; all of them when the key comes without one)."""
    if key not in infos:
        return np.zeros(num_envs, dtype=bool)
    mask = infos.get("_" + key)
    return np.ones(num_envs, dtype=bool) if mask is None else np.array(mask, dtype=bool)


class TensorInfoRecorder:
    """The named infos of each step as tensors ``[T, N, ...]`` with a presence mask ``_key`` per key, on the device.

    Each kept key's value must be a tensor with a leading ``num_envs`` dimension
    (or a dict of such, stored as a nested TensorDict); its structure (shapes,
    dtypes, float64 stored as float32) is fixed by the first step's infos. Which
    infos belong to a row follows the NumPy path: in SAME_STEP mode an env that
    ended takes the key from ``infos["final_info"]`` where that holds it (with
    ``infos["_final_info"]`` as the mask of the envs it covers); in NEXT_STEP mode
    the reset rows' infos are masked out. Presence is ``infos["_" + key]`` where
    the env gives one, else every env. Absent values are stored as 0 (or False).
    """

    def __init__(self, specs: Mapping[str, Any], *, num_envs: int, autoreset_mode: AutoresetMode) -> None:
        if any(example is not None for example in specs.values()):
            raise ValueError(
                "Collector: info_keys examples are for NumPy envs; a vector env of torch tensors gives its infos' "
                "structure at the first step: name the keys only, e.g. BatchKeys(info_keys=('success',))"
            )
        self.keys = list(specs)
        self.num_envs = num_envs
        self.same_step = autoreset_mode == AutoresetMode.SAME_STEP
        self.structures: Mapping[str, Any] | None = None  # the first step's infos, which the rows are shaped like

    def learn(self, reset_infos: Mapping[str, Any], step_infos: Mapping[str, Any]) -> None:
        """Takes the first step's infos as the structure of every key (a torch env gives every key at every step)."""
        self.structures = step_infos

    def _value(self, infos: Mapping[str, Any], key: str) -> Tensor | TensorDictBase | None:
        value = infos.get(key)
        if value is None:
            return None
        if isinstance(value, Mapping):
            value = TensorDict(dict(value), batch_size=[self.num_envs])
        if not isinstance(value, (Tensor, TensorDictBase)) or value.shape[:1] != (self.num_envs,):
            got = tuple(value.shape) if isinstance(value, (Tensor, TensorDictBase)) else type(value).__name__
            raise ValueError(
                f"Collector: info {key!r} of a vector env of torch tensors must be a tensor (or a dict of tensors) "
                f"with a leading size of num_envs={self.num_envs}, got {got}"
            )
        return value

    def empty_rows(self, T: int, device: torch.device) -> TensorDict:
        """Zeroed ``[T, N]`` storage shaped like the first step's infos."""
        infos = self.structures
        assert infos is not None  # learnt from the first step
        final = infos.get("final_info") or {}
        rows = {}
        for key in self.keys:
            value = self._value(infos, key)
            if value is None:
                value = self._value(final, key)
            if value is None:
                raise ValueError(
                    f"Collector: info_keys names {key!r}, but the first step's infos have no such key (they have "
                    f"{sorted(map(str, infos))}); a vector env of torch tensors gives every kept key at every step"
                )
            rows[key] = _zeros_like_rows(value, T, device)
            rows["_" + key] = torch.zeros((T, self.num_envs), dtype=torch.bool, device=device)
        return TensorDict(rows, batch_size=[T, self.num_envs], device=device)

    def record(self, rows: TensorDict, t: int, infos: Mapping[str, Any], done: Tensor, mask: Tensor | None) -> None:
        """Writes row ``t``: each key's value where present, 0 elsewhere, and its presence mask."""
        final = infos.get("final_info") or {}
        final_mask = infos.get("_final_info")
        for key in self.keys:
            value = self._value(infos, key)
            present = infos.get("_" + key)
            present = torch.ones_like(done) if present is None else present.to(done.device, torch.bool)
            if value is None:
                value, present = rows[key][t], torch.zeros_like(done)
            if self.same_step:
                ended = self._value(final, key)
                if ended is not None:
                    covered = done if final_mask is None else done & final_mask.to(done.device, torch.bool)
                    value = where_rows(covered, ended, value)
                    present = present | covered
            if mask is not None:
                present = present & mask
            present = present.to(rows.device)
            rows[key][t] = where_rows(present, value.to(rows.device), 0)
            rows["_" + key][t] = present


def _zeros_like_rows(value: Tensor | TensorDictBase, T: int, device: torch.device) -> Tensor | TensorDictBase:
    if isinstance(value, TensorDictBase):
        return TensorDict(
            {key: _zeros_like_rows(value[key], T, device) for key in value.keys()},
            batch_size=[T, *value.batch_size],
            device=device,
        )
    dtype = torch.float32 if value.dtype == torch.float64 else value.dtype
    return torch.zeros((T, *value.shape), dtype=dtype, device=device)
