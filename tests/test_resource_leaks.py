"""Many lifecycles and a long run: resources come back to their baseline, memory does not creep."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch
from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv, VectorEnv
from tensordict import TensorDict

from torch_rollout import Collector

from reliability_envs import (
    ConstantPolicy,
    Snapshot,
    faulty_fns,
    os_threads,
    rss_bytes,
    wait_until,
    warm_up_multiprocessing,
)

TIMEOUT = 60.0


def one_cycle(cls: type, i: int) -> None:
    """Create, iterate, close: the close path varies with ``i`` (end of data, break, error-free drop)."""
    envs = cls(faulty_fns(2, episode_length=3))
    options = {"num_steps": 4, "device": "cpu", "prefetch": i % 3, "seed": i, "timeout": TIMEOUT}
    if i % 2 == 0:  # runs out of data
        with Collector(envs, ConstantPolicy(), total_timesteps=24, **options) as collector:
            batches = sum(1 for _ in collector)
        assert batches == 3
    else:  # the trainer stops early; the collector is dropped, not closed
        collector = Collector(envs, ConstantPolicy(), **options)
        for _ in collector:
            break
        del collector
    envs.close()


@pytest.mark.parametrize("cls", [SyncVectorEnv, AsyncVectorEnv], ids=lambda c: c.__name__)
def test_60_create_iterate_close_cycles(cls):
    """The comparisons are exact: one thread, child or descriptor left by any cycle fails the test. The close
    path and the prefetch repeat every 6 cycles, so each of their 6 combinations runs 10 times."""
    warm_up_multiprocessing()
    one_cycle(cls, 0)  # first use of torch ops and of the multiprocessing heap happen here
    gc.collect()
    snapshot = Snapshot()
    native_threads = os_threads()
    for i in range(60):
        one_cycle(cls, i)
    snapshot.assert_no_leaks()
    # Native threads too (OpenMP pools, pipe feeder threads): none added by 60 collectors.
    assert wait_until(lambda: os_threads() <= native_threads, TIMEOUT), (native_threads, os_threads())


def own_objects() -> Counter:
    """Live objects of torch_rollout's own types, and of the batch types it makes."""
    counts: Counter = Counter()
    for obj in gc.get_objects():
        kind = type(obj)
        module = getattr(kind, "__module__", None)
        if (isinstance(module, str) and module.startswith("torch_rollout")) or kind is TensorDict:
            counts[f"{module}.{kind.__qualname__}"] += 1
    return counts


def sync_envs() -> SyncVectorEnv:
    return SyncVectorEnv(faulty_fns(2, episode_length=3))


def envpool_async_envs() -> VectorEnv:
    envpool = pytest.importorskip("envpool")
    return envpool.make_gymnasium("CartPole-v1", num_envs=4, batch_size=2, seed=1)


@pytest.mark.filterwarnings("ignore:.*precision lowered:UserWarning")  # gymnasium on EnvPool's float64 bounds
@pytest.mark.parametrize("ends", ["end_of_data", "dropped"])
@pytest.mark.parametrize("make_envs", [sync_envs, envpool_async_envs], ids=["sync", "envpool_async"])
def test_a_closed_collector_leaves_its_envs_in_no_reference_cycle(make_envs, ends):
    """Dropped envs are freed at once, not by a later garbage collection that may run in a forked child.

    An EnvPool freed by the garbage collector of a child forked meanwhile (an AsyncVectorEnv's worker)
    crashes that child with SIGSEGV: it joins threads that only the parent has.
    """
    envs = make_envs()
    kind = type(envs)
    options = {"num_steps": 4, "device": "cpu", "backend": "thread", "timeout": TIMEOUT}
    gc.collect()
    gc.disable()
    try:
        if ends == "end_of_data":
            with Collector(envs, ConstantPolicy(), total_timesteps=24, prefetch=1, **options) as collector:
                for _ in collector:
                    pass
        else:
            collector = Collector(envs, ConstantPolicy(), prefetch=0, **options)
            next(iter(collector))
        envs.close()
        del envs, collector
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cycled = [obj for obj in gc.garbage if type(obj) is kind]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cycled == []


@pytest.mark.slow
def test_soak_5000_batches():
    """5,000 batches with GAE: RSS grows < 50 MB after warm-up, no growth of the collector's objects."""
    envs = SyncVectorEnv(faulty_fns(4, episode_length=7))
    warm_up, total, prefetch = 500, 5000, 2
    collector = Collector(
        envs, ConstantPolicy(), num_steps=16, device="cpu", prefetch=prefetch, total_timesteps=total * 16 * 4
    )

    def quiet_snapshot() -> tuple[int, Counter]:
        # Object counts at comparable moments: the thread has filled its prefetch and waits (it holds
        # no half-built batch), the trainer holds no batch of its own.
        assert wait_until(lambda: len(collector._placement.ready) == prefetch, TIMEOUT)
        gc.collect()
        return rss_bytes(), own_objects()

    with collector:
        for i, batch in enumerate(collector):
            loss = batch["advantage"][batch["mask"]].square().mean()  # the trainer touches each batch
            assert torch.isfinite(loss)
            del batch, loss
            if i == warm_up:
                rss_before, objects_before = quiet_snapshot()
            elif i == total - 1 - prefetch:  # the last batch whose successors are all collected
                rss_after, objects_after = quiet_snapshot()
    envs.close()
    print(
        f"soak: RSS {rss_before / 2**20:.1f} MiB after batch {warm_up}, "
        f"{rss_after / 2**20:.1f} MiB after batch {total - 1 - prefetch} (+{prefetch} collected ahead)"
    )
    assert i == total - 1
    assert rss_after - rss_before < 50 * 2**20
    # The rows batches are written in are kept for reuse, at most prefetch + 2 of them (the loop's RowRing) and the
    # rows being filled: a trainer that still held a batch when the loop needed rows made the loop allocate rows
    # once more, up to that bound, which is no leak (seen once on a loaded machine). Every other object counts the
    # same, and so does everything of a rows.
    rows = "torch_rollout.loop._rows.HostRows"
    assert objects_after[rows] <= prefetch + 2 + 1, objects_after
    grown = objects_after[rows] - objects_before[rows]
    of_rows = {rows, "torch_rollout.envs._spaces.ObsBuffer", "tensordict._td.TensorDict"}  # one of each per rows
    assert all(objects_after[kind] - objects_before[kind] == grown for kind in of_rows), (objects_before, objects_after)
    assert {k: n for k, n in objects_after.items() if k not in of_rows} == {
        k: n for k, n in objects_before.items() if k not in of_rows
    }
