"""Bad input, background errors and shutdown."""

from __future__ import annotations

import functools
import gc
import inspect
import re
import subprocess
import sys
import textwrap
import threading
import traceback

import gymnasium as gym
import pytest
import torch
from gymnasium.vector import SyncVectorEnv
from torch import nn

from torch_rollout import GAE, Collector, gym_envs

from counting_env import CountingEnv, CountingPolicy, make_counting_envs


def collector_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "torch_rollout-collector"]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    yield
    gc.collect()
    assert collector_threads() == []


class FnPolicy(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, obs):
        return self.fn(obs)


def first_batch(policy, *, envs=None, **kwargs):
    envs = envs or make_counting_envs(2)
    try:
        with Collector(envs, policy, num_steps=4, device="cpu", **kwargs) as collector:
            return next(iter(collector))
    finally:
        envs.close()


# -- constructor arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_steps": 0}, ValueError, "Collector: num_steps must be an int >= 1, got 0"),
        ({"num_steps": -3}, ValueError, "Collector: num_steps must be an int >= 1, got -3"),
        ({"num_steps": 2.5}, TypeError, "Collector: num_steps must be an int >= 1, got float 2.5"),
        ({"num_steps": True}, TypeError, "Collector: num_steps must be an int >= 1, got bool True"),
        ({"num_steps": 4, "prefetch": -1}, ValueError, "Collector: prefetch must be an int >= 0, got -1"),
        ({"num_steps": 4, "total_timesteps": 0}, ValueError, "Collector: total_timesteps must be an int >= 1, got 0"),
        (
            {"num_steps": 4, "gae": 0.99},
            TypeError,
            "Collector: gae must be a torch_rollout.GAE(gamma=..., gae_lambda=...) or None, got float 0.99",
        ),
        (
            {"num_steps": 4, "keys": "obs"},
            TypeError,
            "Collector: keys must be a torch_rollout.BatchKeys(obs_key=..., info_keys=..., next_obs=...), got str "
            "'obs'",
        ),
        (
            {"num_steps": 4, "keys": {"next_obs": True}},
            TypeError,
            "Collector: keys must be a torch_rollout.BatchKeys(obs_key=..., info_keys=..., next_obs=...), got dict "
            "{'next_obs': True}; pass keys=torch_rollout.BatchKeys(**{'next_obs': True})",
        ),
        (
            {"num_steps": 4, "device": "gpu"},
            ValueError,
            "Collector: device='gpu' is not a torch device; expected 'cpu', 'cuda', 'cuda:1', 'mps', a torch.device, "
            "or None",
        ),
        (
            {"num_steps": 4, "device": 1.5},
            TypeError,
            "Collector: device must be a torch.device, a device string such as 'cpu', 'cuda' or 'cuda:1', or None, "
            "got float 1.5",
        ),
        ({"num_steps": 4, "gamma": 1.5}, TypeError, "Collector: gamma= is now gae=torch_rollout.GAE(gamma=1.5)"),
        (
            {"num_steps": 4, "info_keys": ("x",), "obs_key": "o"},
            TypeError,
            "Collector: info_keys= is now keys=torch_rollout.BatchKeys(info_keys=('x',)); "
            "obs_key= is now keys=torch_rollout.BatchKeys(obs_key='o')",
        ),
        (
            {"num_steps": 4, "timeout": 0},
            ValueError,
            "Collector: timeout must be a positive number of seconds or None, got 0",
        ),
        ({"num_steps": 4, "num_envs": 3}, ValueError, "Collector: num_envs=3 but the given vector env has num_envs=2"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_arguments(kwargs, error, message):
    envs = make_counting_envs(2)
    kwargs = {"device": "cpu", **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        Collector(envs, CountingPolicy(), **kwargs)
    envs.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gamma": 1.5}, "GAE: gamma must be a float in [0, 1], got 1.5"),
        ({"gae_lambda": -0.1}, "GAE: gae_lambda must be a float in [0, 1], got -0.1"),
        ({"gamma": True}, "GAE: gamma must be a float in [0, 1], got True"),
    ],
    ids=["gamma", "gae_lambda", "bool"],
)
def test_bad_gae_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GAE(**kwargs)


@pytest.mark.parametrize(
    "device, machine, message",
    [
        (
            "cuda",
            {"cuda": None, "gpus": 0},
            "Collector: device='cuda' needs a CUDA GPU, but torch.cuda.is_available() is False (this torch, {torch}, "
            "is built without CUDA); pass device='cpu' (or device=None: CUDA when available, else the CPU), or install "
            "a CUDA build of torch on a machine with an NVIDIA GPU and its driver",
        ),
        (
            torch.device("cuda", 0),
            {"cuda": "12.6", "gpus": 0},
            "Collector: device=device(type='cuda', index=0) needs a CUDA GPU, but torch.cuda.is_available() is False "
            "(this torch, {torch}, is built with CUDA 12.6, but sees no GPU or driver); pass device='cpu'",
        ),
        (
            "cuda:3",
            {"cuda": "12.6", "gpus": 2},
            "Collector: device='cuda:3', but torch.cuda.device_count() is 2; pass a CUDA device from 'cuda:0' to "
            "'cuda:1', or device='cuda' (the current one)",
        ),
        (
            "mps",
            {"mps": False},
            "Collector: device='mps' needs Apple's MPS, but torch.backends.mps.is_available() is False; pass "
            "device='cpu' (MPS needs a Mac with macOS 12.3 or later)",
        ),
    ],
    ids=["cuda-cpu-build", "cuda-no-driver", "cuda-index", "mps"],
)
def test_a_device_this_machine_lacks_is_refused_before_any_env_is_built(device, machine, message, monkeypatch):
    # The machine as the case describes it, whatever this one has.
    if "gpus" in machine:
        monkeypatch.setattr(torch.version, "cuda", machine["cuda"])
        monkeypatch.setattr(torch.cuda, "is_available", lambda: machine["gpus"] > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: machine["gpus"])
    else:
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: machine["mps"])
    built = []

    def make_envs(num_envs):
        built.append(num_envs)
        return make_counting_envs(num_envs)

    with pytest.raises(ValueError, match=re.escape(message.format(torch=torch.__version__))):
        Collector(make_envs, CountingPolicy(), num_envs=2, num_steps=4, device=device, backend="thread")
    assert built == []


def test_collector_has_at_most_15_parameters_and_old_keywords_name_their_new_spelling():
    assert len(inspect.signature(Collector).parameters) <= 15
    envs = make_counting_envs(2)
    with pytest.raises(
        TypeError, match=re.escape("Collector: double_buffer= is now envs=torch_rollout.double_buffered(")
    ):
        Collector(envs, CountingPolicy(), num_steps=4, device="cpu", double_buffer=True)
    assert not envs.closed  # refused before anything was built or claimed
    with Collector(envs, CountingPolicy(), num_steps=4, device="cpu", backend="thread") as collector:
        next(collector)
    envs.close()


@pytest.fixture
def registered():
    """Registers gymnasium ids for one test (``registered(id, **spec)``) and unregisters them after it."""
    ids = []

    def register(env_id: str, **spec: object) -> str:
        gym.register(env_id, **spec)
        ids.append(env_id)
        return env_id

    yield register
    for env_id in ids:
        del gym.registry[env_id]


def test_a_registered_id_that_gymnasium_cannot_build_gets_gymnasium_own_message(registered):
    wrapped = registered(
        "TorchRolloutWrapped-v0",
        entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv",
        vector_entry_point="gymnasium.envs.classic_control.cartpole:CartPoleVectorEnv",
        additional_wrappers=(gym.wrappers.TimeAwareObservation.wrapper_spec(),),
    )
    message = (
        "Collector: gymnasium.make_vec('TorchRolloutWrapped-v0', num_envs=2) failed for the registered env id "
        "'TorchRolloutWrapped-v0': Error: Cannot use `vector_entry_point` vectorization mode with the "
        "additional_wrappers parameter in spec being not empty"
    )
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        Collector(wrapped, CountingPolicy(), num_envs=2, num_steps=4, backend="thread")
    assert "unknown env id" not in str(info.value)
    assert str(info.value).endswith(
        "; gym_envs('TorchRolloutWrapped-v0', vectorization_mode='sync') builds it from its single-env entry point "
        "instead"
    )
    recipe = gym_envs("CartPole-v1", vectorization_mode="vector_entry_point", vector_kwargs={"copy": False})
    message = (
        "Collector: gymnasium.make_vec('CartPole-v1', num_envs=2, vectorization_mode='vector_entry_point', "
        "vector_kwargs={'copy': False}) failed for the registered env id 'CartPole-v1': Error: Custom vector "
        "environment can be passed arguments only through kwargs and `vector_kwargs` is not empty"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        recipe(2)
    with pytest.raises(ValueError, match=re.escape("Collector: unknown env id envs='NoSuchEnv-v0'")):
        gym_envs("NoSuchEnv-v0")(2)


def _mani_skill_make(env_id: str, **kwargs: object) -> None:
    raise AssertionError("ManiSkill's make must not be called")


_mani_skill_make.__module__ = "mani_skill.utils.registration"  # where ManiSkill's own make lives


@pytest.mark.parametrize(
    "entry_point",
    [
        pytest.param("mani_skill.envs.tasks.fake:FakePickCubeEnv", id="string"),
        pytest.param(functools.partial(_mani_skill_make, env_id="TorchRolloutFakePickCube-v1"), id="partial"),
    ],
)
def test_mani_skill_ids_are_refused_with_the_recipe_to_use(registered, entry_point):
    env_id = registered("TorchRolloutFakePickCube-v1", entry_point=entry_point)
    message = (
        "Collector: envs='TorchRolloutFakePickCube-v1' is a ManiSkill env, which ManiSkill builds with its own "
        "gymnasium.make('TorchRolloutFakePickCube-v1', num_envs=2) and vector wrapper, not with "
        "gymnasium.make_vec; pass a function that builds it as envs:\n"
        "    def make_envs(num_envs):\n"
        "        import mani_skill.envs  # registers the ids\n"
        "        from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv\n"
        "        return ManiSkillVectorEnv(gymnasium.make('TorchRolloutFakePickCube-v1', num_envs=num_envs), num_envs)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        Collector(env_id, CountingPolicy(), num_envs=2, num_steps=4, backend="thread")
    with pytest.raises(ValueError, match=re.escape(message)):
        gym_envs(env_id, obs_mode="state")(2)


def test_bad_envs_and_policy_arguments():
    with pytest.raises(ValueError, match=re.escape("Collector: unknown env id envs='NoSuchEnv-v0'")):
        Collector("NoSuchEnv-v0", CountingPolicy(), num_envs=2, num_steps=4)
    with pytest.raises(
        ValueError, match=re.escape("Collector: num_envs is required with an env id or a function (envs='CartPole-v1')")
    ):
        Collector("CartPole-v1", CountingPolicy(), num_steps=4)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "Collector: envs must be a gymnasium.vector.VectorEnv, an env id str or a function "
            "make_envs(num_envs) -> VectorEnv, got CountingEnv (wrap a single env"
        ),
    ):
        Collector(CountingEnv(), CountingPolicy(), num_steps=4)

    class BatchedEnv(CountingEnv):  # a gymnasium.Env stepping many envs at once, without Isaac Lab's cfg
        num_envs = 64

    with pytest.raises(
        TypeError,
        match=re.escape(
            "got BatchedEnv with num_envs=64, a batched env: present it as a gymnasium.vector.VectorEnv of its "
            "num_envs envs (torch_rollout.envs.FromIsaacLab does so for Isaac Lab's own envs"
        ),
    ):
        Collector(BatchedEnv(), CountingPolicy(), num_steps=4)
    envs = make_counting_envs(2)
    with pytest.raises(TypeError, match=re.escape("Collector: policy must be a torch.nn.Module, got function")):
        Collector(envs, lambda obs: obs, num_steps=4)
    envs.close()


def test_unsupported_spaces_are_named():
    class TupleObs(CountingEnv):
        def __init__(self):
            super().__init__()
            self.observation_space = gym.spaces.Tuple([gym.spaces.Discrete(2)])

    class TextAction(CountingEnv):
        def __init__(self):
            super().__init__()
            self.action_space = gym.spaces.Text(5)

    envs = SyncVectorEnv([TupleObs])
    with pytest.raises(
        TypeError, match=re.escape("Collector: unsupported observation_space Tuple(Discrete(2)); expected Box")
    ):
        Collector(envs, CountingPolicy(), num_steps=4, device="cpu")
    envs.close()
    envs = SyncVectorEnv([TextAction])
    with pytest.raises(TypeError, match=re.escape("Collector: unsupported action_space Text(")):
        Collector(envs, CountingPolicy(), num_steps=4, device="cpu")
    envs.close()


def test_lockstep_policy_on_another_device_is_an_error():
    policy = CountingPolicy().to("meta")
    envs = make_counting_envs(1)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Collector: with prefetch=0 the policy runs as given, but its tensor 'scale' is on meta, not on device=cpu"
        ),
    ):
        Collector(envs, policy, num_steps=4, prefetch=0, device="cpu")
    envs.close()


# -- policy outputs (raised by next()) -----------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 1], ids=lambda p: f"prefetch{p}")
@pytest.mark.parametrize(
    "fn, error, message",
    [
        (
            lambda obs: {"value": torch.zeros(obs.shape[0]), "logits": torch.zeros(obs.shape[0], 3)},
            ValueError,
            "Collector: policy output has no 'action' key; it returned keys ['logits', 'value']",
        ),
        (
            lambda obs: {"actions": torch.zeros(obs.shape[0], dtype=torch.long), "value": torch.zeros(obs.shape[0])},
            ValueError,
            "Collector: policy output has no 'action' key; it returned keys ['actions', 'value']: did you mean to "
            "return 'actions' as 'action'?",
        ),
        (
            lambda obs: torch.zeros(obs.shape[0]),
            TypeError,
            "Collector: policy must return a Mapping[str, Tensor] or a TensorDict with an 'action' key, got Tensor",
        ),
        (
            lambda obs: {"action": torch.zeros(obs.shape[0] + 1, dtype=torch.long)},
            ValueError,
            "Collector: policy output 'action' has shape (3,), expected a leading size of 2 (one row per env)",
        ),
        (
            lambda obs: {"action": torch.zeros(obs.shape[0], 1, dtype=torch.long)},
            ValueError,
            "Collector: policy output 'action' has shape (2, 1), expected (2,) (num_envs, *action_space.shape)",
        ),
        (
            lambda obs: {"action": torch.zeros(obs.shape[0])},
            TypeError,
            "Collector: policy output 'action' has dtype torch.float32, expected an integer dtype for Discrete(3)",
        ),
        (
            lambda obs: {"action": torch.zeros(obs.shape[0], dtype=torch.long), "value": torch.zeros(obs.shape[0], 2)},
            ValueError,
            "Collector: policy output 'value' has shape (2, 2) and dtype torch.float32, expected a floating-point "
            "tensor of shape (2,) or (2, 1)",
        ),
        (
            lambda obs: {"action": torch.zeros(obs.shape[0], dtype=torch.long), "value": [0.0, 0.0]},
            TypeError,
            "Collector: policy output 'value' must be a torch.Tensor of shape [2, ...], got list",
        ),
        (
            lambda obs: {"action": torch.zeros(obs.shape[0], dtype=torch.long), "h": torch.zeros(())},
            ValueError,
            "Collector: policy output 'h' has shape (), expected a leading size of 2",
        ),
        (
            lambda obs: {"action": torch.zeros(obs.shape[0], dtype=torch.long), "reward": torch.zeros(obs.shape[0])},
            ValueError,
            "Collector: the policy returns ['reward'], keys the collector fills in every batch",
        ),
        (
            lambda obs: {"action": torch.zeros(obs.shape[0], dtype=torch.long), "obs": obs},
            ValueError,
            "Collector: the policy returns 'obs', the batch key of the observations (obs_key); rename that output",
        ),
    ],
    ids=[
        "no-action",
        "action-misspelt",
        "not-mapping",
        "action-rows",
        "action-shape",
        "action-dtype",
        "value-shape",
        "not-tensor",
        "scalar",
        "batch-key",
        "obs-key",
    ],
)
def test_bad_policy_outputs(fn, error, message, prefetch):
    with pytest.raises(error, match=re.escape(message)):
        first_batch(FnPolicy(fn), prefetch=prefetch)


# -- errors in the background -------------------------------------------------------------------


class EnvFailure(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"env broke with code {code}")
        self.code = code


class FailingEnv(CountingEnv):
    def step(self, action):
        if len(self.log) == 6:
            raise EnvFailure(42)
        return super().step(action)


gym.register("TorchRolloutFailing-v0", entry_point=FailingEnv)


@pytest.mark.parametrize("prefetch", [0, 1, 3], ids=lambda p: f"prefetch{p}")
def test_env_error_reaches_consumer_with_traceback(prefetch):
    # The env id is registered in this process only: the thread (workers would not know it).
    collector = Collector(
        "TorchRolloutFailing-v0",
        CountingPolicy(),
        num_envs=2,
        num_steps=4,
        prefetch=prefetch,
        backend="thread",
        device="cpu",
    )
    batches = []
    with pytest.raises(EnvFailure, match="env broke with code 42") as info:
        for batch in collector:
            batches.append(batch)
    assert info.value.code == 42  # the very exception object, not a re-wrapped one
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "step" in frames and "collect" in frames
    assert len(batches) == 1  # the first 4 steps arrived before the failure
    assert collector.closed and collector.envs.closed
    assert collector_threads() == []  # the background thread has stopped (in lockstep there never was one)
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "Collector: cannot iterate after the background collection failed with EnvFailure: env broke with code 42"
        ),
    ):
        next(collector)


def test_policy_error_reaches_consumer():
    def fn(obs):
        raise ZeroDivisionError("policy exploded")

    with pytest.raises(ZeroDivisionError, match="policy exploded"):
        first_batch(FnPolicy(fn), prefetch=1)


# -- shutdown --------------------------------------------------------------------------------------


def test_close_is_idempotent_and_stops_the_thread():
    envs = make_counting_envs(2)
    collector = Collector(envs, CountingPolicy(), num_steps=4, device="cpu", prefetch=2)
    next(collector)
    collector.close()
    collector.close()
    assert collector_threads() == []
    assert not envs.closed  # not created by the collector: the caller closes it
    with pytest.raises(RuntimeError, match=re.escape("Collector: cannot iterate a closed collector")):
        next(collector)
    envs.close()


def test_break_inside_with_leaves_no_thread():
    envs = make_counting_envs(2)
    with Collector(envs, CountingPolicy(), num_steps=4, device="cpu", prefetch=1) as collector:
        for i, _ in enumerate(collector):
            if i == 2:
                break
    assert collector.closed and collector_threads() == []
    envs.close()


def test_garbage_collection_closes():
    collector = Collector(
        "TorchRolloutCounting-v0", CountingPolicy(), num_envs=2, num_steps=4, device="cpu", backend="thread"
    )
    next(collector)
    envs = collector.envs
    del collector
    gc.collect()
    assert collector_threads() == []
    assert envs.closed


def test_interpreter_exit_with_running_collector_does_not_hang():
    script = textwrap.dedent(
        """
        import torch
        from torch import nn
        from torch_rollout import Collector

        class Policy(nn.Module):
            def forward(self, obs):
                return {"action": torch.zeros(obs.shape[0], dtype=torch.long)}

        collector = Collector("CartPole-v1", Policy(), num_envs=2, num_steps=8, prefetch=2, device="cpu")
        next(collector)
        print("collected")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "collected" in result.stdout
