"""ReplayRing: a collector's rows written straight into a ring, exactly the real rows its batches hold.

Twin collectors with the same seeds, one iterated as usual and one filling a ring: the ring must hold
the batches' real rows (``mask`` True) in the order ``t * num_envs + env``, around the ring's end too,
in every placement, autoreset mode and env kind.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDict

from torch_rollout import BatchKeys, Collector, Processes, ReplayRing
from torch_rollout.envs import CartPole, FromRslRl

from counting_env import TransitionCountingPolicy, counting_vec
from placements import PLACEMENTS, envs_for, on_ray
from reliability_envs import AUTORESET_MODES

N, T, BATCHES = 3, 7, 6
KEYS = ("obs", "action", "reward", "next_obs", "terminated", "truncated", "episode_length")


def twin(placement, make_envs, **kwargs):
    envs, extra = envs_for(placement, make_envs, N)
    kwargs = {
        "num_steps": T,
        "total_timesteps": BATCHES * T * N,
        "keys": BatchKeys(next_obs=True),
        "seed": 3,
        "gae": None,
        "device": "cpu",
        "timeout": 60.0,
        **placement,
        **extra,
        **kwargs,
    }
    return Collector(envs, TransitionCountingPolicy(), **kwargs)


def real_rows(batches: list[TensorDict]) -> TensorDict:
    """Every batch's rows in the order ``t * N + env``, the rows with ``mask`` False left out."""
    rows = torch.cat([batch.reshape(-1) for batch in batches])
    return rows[rows["mask"]].select(*KEYS)


@pytest.mark.ray
@pytest.mark.parametrize("mode", AUTORESET_MODES, ids=lambda mode: mode.value)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_ring_holds_the_real_rows_of_the_batches(placement, mode):
    make_envs = partial(counting_vec, mode=mode)
    with twin(placement, make_envs) as collector:
        expected = real_rows(list(collector))
    capacity = len(expected) - 5  # the last batch wraps around the ring's end
    ring = ReplayRing(capacity, KEYS)
    with twin(placement, make_envs) as collector:
        written = list(ring.fill(collector))
    assert sum(written) == len(expected) and len(ring) == capacity
    if mode != AutoresetMode.NEXT_STEP:
        assert written == [T * N] * BATCHES  # no reset rows to leave out
    held = ring.rows()
    for key in KEYS:
        assert torch.equal(held[key], expected[key][-capacity:]), key
    assert ring.position == len(expected) % capacity


class _CountingRing(ReplayRing):
    """Counts the batches whose rows it took from the loop's arrays, without a TensorDict."""

    taken = 0

    def _take(self, rows):
        written = super()._take(rows)
        self.taken += written is not None
        return written


class _ActingOnly(TransitionCountingPolicy):
    """The counting policy without a value: a Q-network's or an actor's outputs (no bootstrap call)."""

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(obs)
        del out["value"]
        return out


def _fill_as_the_batches(collector, keys):
    """Iterates one ``collector()`` and fills a :class:`_CountingRing` from a twin, around the ring's end; checks
    that the ring holds the batches' real rows of ``keys``. Returns the ring, those rows and the batches it could
    take in place: all but the first (the storage is made from it), the one around the ring's end and those with
    reset rows to leave out."""
    with collector() as batches:
        made = list(batches)
    rows = torch.cat([batch.reshape(-1).select(*keys) for batch in made])
    expected = rows[rows["mask"]]
    clean = sum(bool(batch["mask"].all()) for batch in made[1:-1])
    capacity = len(expected) - 5  # the last batch wraps around the ring's end
    ring = _CountingRing(capacity, keys)
    with collector() as batches:
        written = list(ring.fill(batches))
    assert sum(written) == len(expected) and len(ring) == capacity
    held = ring.rows()
    for key in keys:
        assert torch.equal(held[key], expected[key][-capacity:]), key
    assert ring.position == len(expected) % capacity
    return ring, expected, clean


@pytest.mark.parametrize("mode", AUTORESET_MODES, ids=lambda mode: mode.value)
@pytest.mark.parametrize("policy", [_ActingOnly, TransitionCountingPolicy], ids=["no-value", "value"])
@pytest.mark.parametrize(
    "placement",
    [
        pytest.param({"backend": "thread", "prefetch": 0}, id="thread"),
        pytest.param({"backend": Processes(1), "prefetch": 1, "timeout": 60.0}, id="process1"),
        pytest.param({"backend": Processes(2), "prefetch": 0, "timeout": 60.0}, id="process2"),
        *[
            pytest.param({**param.values[0], "prefetch": 1, "timeout": 60.0}, id=param.id, marks=param.marks)
            for param in PLACEMENTS
            if on_ray(param.values[0])
        ],
    ],
)
@pytest.mark.ray(mode=(AutoresetMode.SAME_STEP, AutoresetMode.DISABLED))
def test_the_ring_takes_the_rows_in_place_as_the_batches_hold_them(mode, policy, placement):
    """The ring copies rows from the loop's arrays (thread, prefetch=0), the workers' slots (processes) or the
    actors' arrays (Ray) without a batch made, where they fit; its rows are the batches' rows."""
    keys = (*KEYS, "done", "mask", "log_prob", "episode_return")
    if not placement["prefetch"]:  # collected ahead, a batch's versions depend on when the worker ran
        keys += ("policy_version",)
    make_envs = partial(counting_vec, mode=mode)

    def collector():
        envs, extra = envs_for(placement, make_envs, N)
        return Collector(
            envs, policy(), num_steps=T, total_timesteps=BATCHES * T * N, keys=BatchKeys(next_obs=True),
            seed=3, gae=None, device="cpu", **placement, **extra,
        )  # fmt: skip

    ring, _, clean = _fill_as_the_batches(collector, keys)
    if policy is TransitionCountingPolicy and placement["backend"] == "thread":  # bootstrap values: a batch
        assert ring.taken == 0
    else:  # the workers' slots (the actors' arrays) hold the bootstrap values already
        assert ring.taken == clean and (mode == AutoresetMode.NEXT_STEP or clean == BATCHES - 2)


def test_a_prefetching_collector_and_torch_envs_fill_the_ring_as_their_batches():
    def make():
        envs = CartPole(8, autoreset_mode=AutoresetMode.SAME_STEP)
        return Collector(
            envs,
            _PushLeft(),
            num_steps=4,
            total_timesteps=8 * 4 * 9,
            gae=None,
            keys=BatchKeys(next_obs=True),
            seed=1,
            prefetch=1,
            backend="thread",
            device="cpu",
        )

    with make() as collector:
        expected = torch.cat([batch.reshape(-1).select(*KEYS) for batch in collector])
    ring = ReplayRing(1000, KEYS)
    with make() as collector:
        assert list(ring.fill(collector)) == [32] * 9
    held = ring.rows()
    assert len(held) == len(expected) == 288
    for key in KEYS:
        assert torch.equal(held[key], expected[key]), key
    assert held["terminated"].any()  # episodes ended inside: their next_obs are final observations
    assert torch.equal(held["next_obs"][:-8][~held["terminated"][:-8]], held["obs"][8:][~held["terminated"][:-8]])


class _Topple(torch.nn.Module):
    """Pushes the cart away from the side the pole leans to (CartPole's observations): short episodes."""

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": (obs[:, 2] < 0).long()}


class _ToppleBox(torch.nn.Module):
    """:class:`_Topple` for a one-dimensional Box of forces."""

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": -obs[:, 2:3].sign()}


def _rsl_rl_own_finals():
    from test_torch_loop import RslRlCartPole  # its final observations: the rows' own (bootstrap="last_obs")

    return FromRslRl(RslRlCartPole(N, layout="1.x-none", both=True), bootstrap="last_obs")


@pytest.mark.parametrize(
    ("make_envs", "policy", "reset_rows", "seed"),
    [
        *(
            pytest.param(
                partial(CartPole, N, autoreset_mode=mode),
                _Topple,
                mode == AutoresetMode.NEXT_STEP,
                3,
                id=f"CartPole-{mode.value}",
            )
            for mode in AUTORESET_MODES
        ),
        pytest.param(_rsl_rl_own_finals, _ToppleBox, False, None, id="FromRslRl-last_obs"),  # seeded when made
    ],
)
@pytest.mark.parametrize("num_steps", [2, T], ids=["final-obs-dense", "final-obs-gathered"])
def test_a_torch_envs_rows_on_the_cpu_go_into_the_ring_in_place_as_the_batches_hold_them(
    make_envs, policy, reset_rows, seed, num_steps
):
    """Rows of a torch env stored on the CPU are copied from the loop's tensors (no batch made) where they fit;
    the ring's rows are the batches' rows, next observations at episode ends included."""
    keys = (*KEYS, "done", "mask", "policy_version", "episode_return")
    count = BATCHES * T // num_steps  # batches

    def collector():
        return Collector(
            make_envs(), policy(), num_steps=num_steps, total_timesteps=count * num_steps * N,
            keys=BatchKeys(next_obs=True), seed=seed, gae=None, device="cpu", backend="thread", prefetch=0,
        )  # fmt: skip

    ring, expected, clean = _fill_as_the_batches(collector, keys)
    assert expected["done"].any()  # episodes ended inside: their next_obs are final observations
    assert ring.taken == clean and (reset_rows or clean == count - 2)


class _PushLeft(torch.nn.Module):
    """Always pushes the cart left: the pole falls within a dozen steps."""

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"action": torch.zeros(obs.shape[0], dtype=torch.long)}


def test_write_takes_a_batch_the_trainer_iterated():
    with twin({"backend": "thread"}, counting_vec) as collector:
        batches = list(collector)
    ring = ReplayRing(10_000, ("obs", "next_obs"))
    assert [ring.write(batch) for batch in batches] == [int(batch["mask"].sum()) for batch in batches]
    expected = real_rows(batches)
    assert torch.equal(ring.rows()["next_obs"], expected["next_obs"])
    sample = ring.sample(64, generator=torch.Generator().manual_seed(0))
    index = torch.randint(len(ring), (64,), generator=torch.Generator().manual_seed(0))
    assert sample.batch_size == (64,) and torch.equal(sample["obs"], expected["obs"][index])


def test_ring_errors_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match=r"capacity must be a positive int, got 0"):
        ReplayRing(0)
    with pytest.raises(TypeError, match=r"got the string 'obs'; pass keys=\('obs',\)"):
        ReplayRing(10, keys="obs")
    with pytest.raises(RuntimeError, match=r"the ring is empty"):
        ReplayRing(10).sample(4)
    with twin({"backend": "thread"}, counting_vec, keys=BatchKeys()) as collector:
        batch = next(iter(collector))
    with pytest.raises(KeyError, match=r"no key 'next_obs' \(pass keys=BatchKeys\(next_obs=True\) to the Collector\)"):
        ReplayRing(100).write(batch)
    with pytest.raises(ValueError, match=r"capacity=5 is smaller than one batch's 21 rows"):
        ReplayRing(5, ("obs",)).write(batch)
    ring = ReplayRing(100, ("obs",))
    ring.write(batch)
    with pytest.raises(ValueError, match=r"'obs' has rows of shape \(2,\), the ring's \(4,\)"):
        ring.write(TensorDict({"obs": torch.zeros(3, 2), "mask": torch.ones(3, dtype=torch.bool)}, [3]))


def _filled_ring(capacity: int, batches: int) -> tuple[ReplayRing, TensorDict]:
    """A ring written ``batches`` batches of the counting collector, and every real row those batches held."""
    with twin({"backend": "thread"}, counting_vec, total_timesteps=batches * T * N) as collector:
        written = list(collector)
    ring = ReplayRing(capacity, KEYS)
    for batch in written:
        ring.write(batch)
    return ring, real_rows(written)


@pytest.mark.parametrize("capacity", [1000, 50], ids=["partly-full", "wrapped"])
def test_a_saved_ring_loads_back_with_torch_loads_defaults(tmp_path, capacity):
    ring, _ = _filled_ring(capacity, 4)
    path = tmp_path / "ring.pt"
    torch.save(ring.state_dict(), path)
    if capacity > len(ring):  # the copy holds the rows held, not the whole preallocated storage
        assert path.stat().st_size < 4 * len(ring) * 4 * 8 + 10_000
    restored = ReplayRing(capacity, KEYS)
    restored.load_state_dict(torch.load(path))  # weights_only=True, torch's default
    assert (restored.position, len(restored)) == (ring.position, len(ring))
    for key in KEYS:
        assert torch.equal(restored.rows()[key], ring.rows()[key]), key
    # both go on alike: the next writes land in the same places
    more, _ = _filled_ring(capacity, 1)
    for each in (ring, restored):
        each.write(more.rows().unsqueeze(0))
    assert torch.equal(restored.storage["obs"], ring.storage["obs"])
    assert restored.position == ring.position


def test_an_empty_ring_saves_and_loads():
    restored = ReplayRing(10, KEYS)
    restored.load_state_dict(ReplayRing(10, KEYS).state_dict())
    assert len(restored) == 0 and restored.storage is None


def test_loading_a_state_of_another_ring_names_both():
    ring, _ = _filled_ring(1000, 1)
    with pytest.raises(ValueError, match=r"capacity=1000 and keys=\('obs', .*this one has capacity=999"):
        ReplayRing(999, KEYS).load_state_dict(ring.state_dict())
    with pytest.raises(ValueError, match=r"the state lacks \['position', 'rows', 'size'\]"):
        ReplayRing(1000, KEYS).load_state_dict({"capacity": 1000, "keys": KEYS})


def _rows(**values: torch.Tensor) -> TensorDict:
    n = len(next(iter(values.values())))
    return TensorDict({**values, "mask": torch.ones(n, dtype=torch.bool)}, [n])


def test_a_batch_whose_dtype_would_lose_information_is_refused_by_name():
    ring = ReplayRing(100, ("obs", "action"))
    ring.write(_rows(obs=torch.zeros(3, 2), action=torch.zeros(3, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"'obs' is torch.float64, which the ring's torch.float32 storage"):
        ring.write(_rows(obs=torch.zeros(3, 2, dtype=torch.float64), action=torch.zeros(3, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"'action' is torch.float32, which the ring's torch.int64 storage"):
        ring.write(_rows(obs=torch.zeros(3, 2), action=torch.full((3,), 6.7)))
    assert len(ring) == 3  # neither was written
    # a dtype the storage holds exactly is taken
    assert ring.write(_rows(obs=torch.zeros(3, 2, dtype=torch.float16), action=torch.ones(3, dtype=torch.int32)))
    assert ring.rows()["action"].tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_that_require_grad_or_have_no_numpy_dtype_are_written_as_they_are(dtype):
    """A trainer's own batch (values with their graph, bfloat16 observations) writes the same rows as any other."""
    ring = ReplayRing(100, ("obs", "value"))
    written = []
    for k in range(4):  # the first write makes the storage; the later ones take the usual path
        obs = torch.arange(6, dtype=dtype).reshape(3, 2) + k
        value = torch.arange(3.0, requires_grad=True) * (k + 1)
        assert ring.write(_rows(obs=obs, value=value)) == 3
        written.append((obs, value.detach()))
    rows = ring.rows()
    assert rows["obs"].dtype == dtype and not rows["value"].requires_grad
    assert torch.equal(rows["obs"], torch.cat([obs for obs, _ in written]))
    assert torch.equal(rows["value"], torch.cat([value for _, value in written]))


def test_a_dict_observation_leaf_that_changes_is_refused_by_name():
    ring = ReplayRing(100, ("obs",))
    ring.write(_rows(obs=TensorDict({"pos": torch.zeros(3, 2), "img": torch.zeros(3, 4, dtype=torch.uint8)}, [3])))
    with pytest.raises(ValueError, match=r"\('obs', 'pos'\) has rows of shape \(5,\), the ring's \(2,\)"):
        ring.write(_rows(obs=TensorDict({"pos": torch.zeros(3, 5), "img": torch.zeros(3, 4, dtype=torch.uint8)}, [3])))
    with pytest.raises(ValueError, match=r"\('obs', 'img'\) is torch.float32, which the ring's torch.uint8"):
        ring.write(_rows(obs=TensorDict({"pos": torch.zeros(3, 2), "img": torch.zeros(3, 4)}, [3])))


def test_rows_is_a_copy_before_and_after_the_ring_wraps():
    ring = ReplayRing(5, ("obs",))
    ring.write(_rows(obs=torch.arange(3.0).unsqueeze(1)))
    before = ring.rows()
    ring.write(_rows(obs=torch.arange(3.0, 6.0).unsqueeze(1)))  # wraps around
    after = ring.rows()
    ring.write(_rows(obs=torch.full((3, 1), -1.0)))
    assert before["obs"].squeeze(1).tolist() == [0, 1, 2]
    assert after["obs"].squeeze(1).tolist() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_sample_names_a_bad_batch_size(bad):
    ring = ReplayRing(5, ("obs",))
    ring.write(_rows(obs=torch.zeros(3, 1)))
    with pytest.raises(ValueError, match=rf"batch_size must be a positive int \(the rows to draw\), got \w+ {bad!r}"):
        ring.sample(bad)
    assert ring.sample(np.int64(2)).batch_size == (2,)  # an integer of NumPy's is one


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_ring_without_cuda_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"ReplayRing: device='cuda' needs a CUDA GPU.*pass device='cpu'"):
        ReplayRing(10, device="cuda")


def test_the_next_obs_hint_names_the_collector_option_only_when_it_is_missing():
    with twin({"backend": "thread"}, counting_vec) as collector:  # next_obs=True
        batch = next(iter(collector))
    with pytest.raises(KeyError, match=r"no key 'next_state'; its keys are"):
        ReplayRing(100, ("obs", "next_state")).write(batch)
