"""A stand-in for an EnvPool in async mode: CountingEnvs behind ``async_reset``/``send``/``recv``, in a chosen order."""

from __future__ import annotations

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv

from counting_env import CountingEnv


class AsyncCountingPool(VectorEnv):
    """``num_envs`` CountingEnvs stepped like EnvPool's async mode, deterministically.

    ``send(action, env_id)`` steps those envs (an env whose last step ended an
    episode is reset instead: reward 0, NEXT_STEP) and queues their results;
    ``recv()`` returns ``batch_size`` queued results, the ones sent first,
    except that env 0's results become ready only ``lag`` calls of ``recv()``
    after it was sent (a slow env). Whatever EnvPool would do wrong or hang on
    raises AssertionError: a second request for an env in flight, or a
    ``recv()`` with fewer than ``batch_size`` envs in flight (EnvPool waits
    forever). Each CountingEnv logs its real steps (``pool.envs[j].log``).
    """

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP}
    is_async = True

    def __init__(self, num_envs: int, batch_size: int, *, lag: int = 0, seed: int = 0, start_index: int = 0) -> None:
        self.envs = [CountingEnv(start_index + j) for j in range(num_envs)]
        self.num_envs = num_envs
        self.config = {"num_envs": num_envs, "batch_size": batch_size, "seed": seed, "max_num_players": 1}
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.lag = lag
        self.queue: list[tuple[int, int, int, tuple]] = []  # (ready at recv number, send number, env, result)
        self.sends = 0
        self.recvs = 0
        self.ended = np.zeros(num_envs, dtype=bool)
        self.closed = False

    def _queue(self, env: int, result: tuple) -> None:
        assert env not in {item[2] for item in self.queue}, f"env {env} got a request while one was in flight"
        ready = self.recvs + (self.lag if env == 0 else 0)
        self.queue.append((ready, self.sends, env, result))
        self.sends += 1

    def async_reset(self) -> None:
        for j, env in enumerate(self.envs):
            obs, _ = env.reset()
            self._queue(j, (obs, 0.0, False, False))
        self.ended[:] = False

    def send(self, action: np.ndarray, env_id: np.ndarray) -> None:
        assert len(action) == len(env_id), (action.shape, env_id.shape)
        for a, j in zip(action, np.asarray(env_id).tolist()):
            env = self.envs[j]
            if self.ended[j]:
                obs, _ = env.reset()
                result = (obs, 0.0, False, False)
            else:
                obs, reward, terminated, truncated, _ = env.step(a)
                result = (obs, reward, terminated, truncated)
            self.ended[j] = result[2] or result[3]
            self._queue(j, result)

    def recv(self) -> tuple:
        B = self.config["batch_size"]
        assert len(self.queue) >= B, f"recv() with {len(self.queue)} envs in flight, fewer than batch_size={B}"
        self.recvs += 1
        self.queue.sort(key=lambda item: (item[0] > self.recvs, item[0], item[1]))
        taken, self.queue = self.queue[:B], self.queue[B:]
        env_id = np.array([item[2] for item in taken], dtype=np.int32)
        obs, reward, terminated, truncated = (np.array(column) for column in zip(*(item[3] for item in taken)))
        steps = np.array([env.t for env in (self.envs[j] for j in env_id)], dtype=np.int32)
        return obs, reward, terminated, truncated, {"env_id": env_id, "elapsed_step": steps}

    def close(self, **kwargs) -> None:
        self.closed = True


def make_async_counting_pool(
    num_envs: int, start_index: int = 0, *, batch_size: int, lag: int = 0
) -> AsyncCountingPool:
    """A recipe for worker processes (with ``functools.partial``): envs ``start_index ..``, ``batch_size`` per recv."""
    return AsyncCountingPool(num_envs, batch_size, lag=lag, start_index=start_index)
