"""compile_policy=CudaGraph(): the forward replayed as a CUDA graph, with the eager batches, fresh samples and weights.

The argument checks run everywhere. The graph's plumbing (static inputs copied
in, outputs cloned out, eager bootstrap calls, a new recording when the
trainer replaced a parameter) also runs on the CPU, with a simulated graph
whose replay reruns the recorded forward into the same output tensors, as a
CUDA graph overwrites its memory; on a machine with CUDA the same tests run
the real graph. Fresh sampling, weight refreshes and the absence of host syncs
need CUDA.
"""

from __future__ import annotations

import copy
import math
import re
import threading
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torch.distributions import Categorical, Distribution

from torch_rollout import Collector, CudaGraph, Processes
from torch_rollout.envs import CartPole
from torch_rollout.loop import _compile
from torch_rollout.loop._acting import PolicyCall, call_policy
from torch_rollout.loop._compile import acting_call, check_compile_policy

T, N = 7, 6
MAX_STEPS = 9  # prime to T: episodes end inside batches and at their boundaries
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
KEYS = ("obs", "action", "value", "log_prob", "reward", "done", "mask", "next_value", "advantage", "return")
TIMEOUT = 120.0


class LinearPolicy(nn.Module):
    """Deterministic: actions and values from one seeded linear layer of the observation."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = _seeded_linear()

    def forward(self, obs: torch.Tensor) -> dict:
        out = self.layer(obs)
        return {"action": (out[:, 0] > 0).long(), "value": out[:, 1], "log_prob": obs.sum(-1)}


class RecurrentLinearPolicy(LinearPolicy):
    """LinearPolicy with a state: a decaying sum of observations that the values read."""

    def forward(self, obs: torch.Tensor, state: TensorDict, is_init: torch.Tensor) -> dict:
        out = super().forward(obs)
        h = torch.where(is_init.unsqueeze(-1), state["h"], 2.0 * state["h"])
        out["value"] = out["value"] + h.sum(-1)
        out["next_state"] = {"h": 0.5 * h + obs[:, :2]}
        return out


class FixedLogits(nn.Module):
    """Samples action 1 with probability 0.3 in every env (argument checks of torch.distributions on)."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.tensor([math.log(0.7), math.log(0.3)]))
        self.critic = _seeded_linear(out_features=1)

    def forward(self, obs: torch.Tensor) -> dict:
        dist = Categorical(logits=self.logits.expand(obs.shape[0], 2))
        action = dist.sample()
        return {"action": action, "log_prob": dist.log_prob(action), "value": self.critic(obs)[:, 0]}


class NoWeights(nn.Module):
    def forward(self, obs: torch.Tensor) -> dict:
        return {"action": (obs[:, 2] > 0).long(), "value": obs[:, 0]}


def _seeded_linear(out_features: int = 2) -> nn.Linear:
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    layer = nn.Linear(4, out_features)
    torch.random.set_rng_state(state)
    return layer


def h_state(num_envs: int) -> TensorDict:
    return TensorDict({"h": torch.full((num_envs, 2), 0.25)}, batch_size=[num_envs])


class SimulatedGraph:
    """What a CUDA graph does to memory, on the CPU: each replay writes the forward's outputs into the same tensors."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward
        self.outputs = forward()

    def replay(self) -> None:
        _copy_into(self.outputs, self.forward())


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, (torch.Tensor, TensorDictBase)):
        dst.copy_(src)
    elif isinstance(dst, Mapping):
        for key in dst:
            _copy_into(dst[key], src[key])


def simulated_capture(
    forward: Any, config: CudaGraph, device: torch.device, generators: list[torch.Generator]
) -> tuple[SimulatedGraph, Any]:
    graph = SimulatedGraph(forward)
    return graph, graph.outputs


@pytest.fixture(params=["simulated", pytest.param("cuda", marks=NEEDS_CUDA)])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """Where the graph runs: the CPU with a simulated graph, or CUDA with a real one."""
    if request.param == "cuda":
        return torch.device("cuda")
    monkeypatch.setattr(_compile, "_check_cuda", lambda config, device: None)
    monkeypatch.setattr(_compile, "_capture", simulated_capture)
    return torch.device("cpu")


def count_captures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the recordings of graphs from now on (one entry each)."""
    captures: list[int] = []
    capture = _compile._capture

    def counted(*args: Any) -> Any:
        captures.append(1)
        return capture(*args)

    monkeypatch.setattr(_compile, "_capture", counted)
    return captures


def collect(envs: Any, policy: nn.Module, device: torch.device, batches: int = 3, **kwargs: Any) -> list[TensorDict]:
    options = dict(num_steps=T, device=device, seed=5, timeout=TIMEOUT, backend="thread", prefetch=0)
    options["total_timesteps"] = batches * kwargs.get("num_steps", T) * envs.num_envs
    with Collector(envs, policy, **{**options, **kwargs}) as collector:
        return list(collector)


def cartpole(device: torch.device, mode: AutoresetMode = AutoresetMode.NEXT_STEP, num_envs: int = N) -> CartPole:
    return CartPole(num_envs, device=device, autoreset_mode=mode, max_episode_steps=MAX_STEPS)


def assert_same_batches(got: list[TensorDict], expected: list[TensorDict], keys: tuple[str, ...] = KEYS) -> None:
    assert len(got) == len(expected)
    for b, (g, e) in enumerate(zip(got, expected)):
        for key in keys:
            torch.testing.assert_close(g[key], e[key], msg=lambda m, key=key, b=b: f"{key}, batch {b}: {m}")


# -- arguments (everywhere) ------------------------------------------------------------------------


@pytest.mark.parametrize("placement", [{"prefetch": 0}, {"prefetch": 1}, {"backend": Processes(1)}], ids=str)
def test_a_policy_off_cuda_is_refused_at_construction(placement):
    recipe = isinstance(placement.get("backend"), Processes)
    envs = "torch_rollout/CartPole-v1" if recipe else CartPole(N)
    options = {"backend": "thread", **placement}
    message = (
        "Collector: compile_policy=CudaGraph(warmup=3) replays a CUDA graph of the policy's forward, and CUDA "
        "graphs need a CUDA device, but the policy acts on device 'cpu'; pass device='cuda'"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        Collector(
            envs,
            LinearPolicy(),
            num_envs=N if recipe else None,
            num_steps=T,
            device="cpu",
            timeout=TIMEOUT,
            compile_policy=CudaGraph(),
            **options,
        )


def test_a_policy_without_weights_off_cuda_is_refused_at_its_first_call():
    with Collector(
        CartPole(N), NoWeights(), num_steps=T, device="cpu", backend="thread", compile_policy=CudaGraph()
    ) as collector:
        with pytest.raises(
            ValueError, match=re.escape("CUDA graphs need a CUDA device, but the policy acts on device")
        ):
            next(iter(collector))


@pytest.mark.parametrize("warmup", [0, -1, True, 2.0, "3"], ids=repr)
def test_bad_warmup_is_refused(warmup):
    with pytest.raises(ValueError, match=re.escape("CudaGraph: warmup must be an int >= 1 (eager calls")):
        CudaGraph(warmup=warmup)


def test_compile_policy_names_cuda_graph_among_its_values():
    assert check_compile_policy(CudaGraph(warmup=2)) == CudaGraph(warmup=2)
    with pytest.raises(
        TypeError, match=re.escape("or torch_rollout.CudaGraph() to replay a CUDA graph of the forward")
    ):
        check_compile_policy(CudaGraph)  # the class, not an instance


# -- the graph's plumbing (simulated on the CPU, real on CUDA) -------------------------------------


@pytest.mark.parametrize("recurrent", [False, True], ids=["feedforward", "recurrent"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_batches_are_the_eager_ones(device, mode, recurrent, monkeypatch):
    """Every key, in the three autoreset modes (bootstrap calls of fewer envs among them), recurrent state too."""
    policy = (RecurrentLinearPolicy() if recurrent else LinearPolicy()).to(device)
    extra = {"initial_state": h_state} if recurrent else {}
    expected = collect(cartpole(device, mode), policy, device, **extra)
    captures = count_captures(monkeypatch)
    got = collect(cartpole(device, mode), policy, device, compile_policy=CudaGraph(), **extra)
    assert_same_batches(got, expected, KEYS + (("h", "is_init") if recurrent else ()))
    assert len(captures) == 1  # at the first step, and replayed since
    assert torch.cat([batch["done"] for batch in got]).any()


def test_outputs_are_clones_of_the_graphs_memory(device):
    """A result kept from one call is not overwritten by the next replay."""
    policy = LinearPolicy().to(device)
    act = acting_call(policy, CudaGraph(), num_envs=N, obs_key="obs", owned=True)
    obs = torch.randn(2, N, 4, generator=torch.Generator().manual_seed(0)).to(device)
    first = act(PolicyCall(obs[0]))
    kept = {key: value.clone() for key, value in first.items()}
    second = act(PolicyCall(obs[1]))
    for key in kept:
        torch.testing.assert_close(first[key], kept[key])
    for key, value in call_policy(policy, PolicyCall(obs[1])).items():
        torch.testing.assert_close(second[key], value)
    assert not torch.equal(second["value"], first["value"])


class ValuePolicy(LinearPolicy):
    """LinearPolicy with a value-only path that differs from the forward's values."""

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return -self.layer(obs)[:, 1]


def test_value_calls_and_calls_of_fewer_envs_run_eagerly(device, monkeypatch):
    policy = ValuePolicy().to(device)
    act = acting_call(policy, CudaGraph(), num_envs=N, obs_key="obs", owned=True)
    captures = count_captures(monkeypatch)
    obs = torch.randn(N, 4, generator=torch.Generator().manual_seed(0)).to(device)
    for call in (PolicyCall(obs, value_only=True), PolicyCall(obs[:2]), PolicyCall(obs[:2], value_only=True)):
        got, expected = act(call), call_policy(policy, call)
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(got, expected)
        else:
            assert got.keys() == expected.keys()
            for key in expected:
                torch.testing.assert_close(got[key], expected[key])
    assert captures == []


def test_a_replaced_parameter_is_recorded_anew(device, monkeypatch):
    """prefetch=0 acts with the trainer's module: a new nn.Parameter is what the next batch computes with."""

    def run(compile_policy: Any) -> list[TensorDict]:
        policy = LinearPolicy().to(device)
        batches = []
        with Collector(
            cartpole(device),
            policy,
            num_steps=T,
            device=device,
            seed=5,
            backend="thread",
            prefetch=0,
            compile_policy=compile_policy,
        ) as collector:
            for batch in collector:
                batches.append(batch)
                if len(batches) == 3:
                    break
                policy.layer.bias = nn.Parameter(policy.layer.bias.detach() + 0.5)  # a new tensor, not a copy
        return batches

    expected = run(False)
    captures = count_captures(monkeypatch)
    got = run(CudaGraph())
    assert_same_batches(got, expected, ("obs", "action", "value"))
    assert len(captures) == 3  # one per version of the bias


# -- CUDA only -------------------------------------------------------------------------------------


@NEEDS_CUDA
def test_sampling_is_fresh_at_every_replay():
    """A fixed-logit Categorical over 4096 envs: each step's actions are new draws, at the eager rate."""
    cuda = torch.device("cuda")
    num_envs, num_steps = 4096, 8
    actions = {}
    for name, compile_policy in (("graph", CudaGraph()), ("eager", False)):
        batches = collect(
            cartpole(cuda, num_envs=num_envs),
            FixedLogits().to(cuda),
            cuda,
            batches=2,
            num_steps=num_steps,
            compile_policy=compile_policy,
        )
        actions[name] = torch.cat([batch["action"] for batch in batches]).float()  # [2T, N]
        log_prob = torch.cat([batch["log_prob"] for batch in batches])
        expected = torch.where(actions[name] == 1, math.log(0.3), math.log(0.7))
        torch.testing.assert_close(log_prob, expected.to(log_prob.dtype))
    graph = actions["graph"]
    assert (graph[1:] != graph[:-1]).any(1).all()  # frozen sampling would repeat the same actions at every step
    step_means = graph.mean(1)  # 4096 draws each: std 0.007
    assert ((step_means - 0.3).abs() < 0.04).all(), step_means
    assert abs(graph.mean().item() - actions["eager"].mean().item()) < 0.015  # 65536 draws each: std 0.0018


@NEEDS_CUDA
@pytest.mark.parametrize("prefetch", [0, 1], ids=lambda p: f"prefetch{p}")
def test_weight_refreshes_reach_the_replays(prefetch):
    """Each row's values are those of the weights version that acted it: SGD steps, then a replaced parameter."""
    cuda = torch.device("cuda")
    policy = LinearPolicy().to(cuda)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    snapshots: list[nn.Module] = []  # the trainer's weights at each version
    batches = []
    with Collector(
        cartpole(cuda),
        policy,
        num_steps=T,
        device=cuda,
        seed=5,
        backend="thread",
        prefetch=prefetch,
        compile_policy=CudaGraph(),
    ) as collector:
        it = iter(collector)
        for b in range(4):
            now = copy.deepcopy(policy)
            batch = next(it)
            snapshots += [now] * (collector.policy_version + 1 - len(snapshots))
            batches.append(batch)
            if b == 1:
                policy.layer.bias = nn.Parameter(policy.layer.bias.detach() - 1.0)
            else:
                loss = policy(batch["obs"].flatten(0, 1))["value"].pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    assert batches[-1]["policy_version"].min() > 1  # the last batch was acted by refreshed weights
    with torch.no_grad():
        for batch in batches:
            for t in range(T):
                acting = snapshots[int(batch["policy_version"][t, 0])]
                torch.testing.assert_close(batch["value"][t], acting(batch["obs"][t])["value"])


@NEEDS_CUDA
@pytest.mark.parametrize("prefetch", [0, 1], ids=lambda p: f"prefetch{p}")
def test_steady_state_batches_have_no_host_sync(prefetch):
    cuda = torch.device("cuda")
    envs = cartpole(cuda)
    with Collector(
        envs,
        LinearPolicy().to(cuda),
        num_steps=T,
        device=cuda,
        seed=5,
        backend="thread",
        prefetch=prefetch,
        compile_policy=CudaGraph(),
    ) as collector:
        batches = iter(collector)
        next(batches)  # records the graph: capture synchronises the device
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):  # NEXT_STEP: no batch end gathers the rows that ended
                next(batches)
        finally:
            torch.cuda.set_sync_debug_mode("default")


class ReadsBack(LinearPolicy):
    """Reads a value back to the host at every call: it cannot be recorded."""

    def forward(self, obs: torch.Tensor) -> dict:
        out = super().forward(obs)
        out["value"] = out["value"] * float(obs[0, 0].item() > 0)
        return out


@NEEDS_CUDA
def test_a_forward_that_cannot_be_recorded_is_named_and_leaves_eager_cuda_working():
    cuda = torch.device("cuda")
    with pytest.raises(
        RuntimeError, match=r"compile_policy=CudaGraph\(warmup=3\)\): recording the policy's forward"
    ) as info:
        collect(cartpole(cuda), ReadsBack().to(cuda), cuda, batches=1, compile_policy=CudaGraph())
    assert "random generators are out of capture mode" in str(info.value)
    assert Distribution._validate_args == __debug__  # the argument checks are back on after the capture
    # The error's advice works in this process: eager random ops on the device, an eager collector that samples.
    assert torch.rand(1, device=cuda).device.type == "cuda"
    assert torch.cuda.current_stream(cuda) == torch.cuda.default_stream(cuda)
    assert len(collect(cartpole(cuda), FixedLogits().to(cuda), cuda, batches=1)) == 1


def test_torch_before_2_5_is_refused_for_cuda_graphs(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    with pytest.raises(
        ValueError, match=re.escape("compile_policy=CudaGraph(warmup=3) needs torch >= 2.5, found torch 2.4.1")
    ):
        check_compile_policy(CudaGraph())
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu128")
    assert check_compile_policy(CudaGraph()) == CudaGraph()


class OwnGenerator(nn.Module):
    """Samples from a generator of its own: recordable only when the graph registers it."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.critic = _seeded_linear(out_features=1)
        self.generator = torch.Generator(device=device).manual_seed(1)

    def forward(self, obs: torch.Tensor) -> dict:
        noise = torch.rand(obs.shape[0], device=obs.device, generator=self.generator)
        return {"action": (noise < 0.3).long(), "value": self.critic(obs)[:, 0] + noise}


def test_the_policy_s_own_generators_are_found():
    policy = OwnGenerator(torch.device("cpu"))
    assert _compile._own_generators(policy, torch.device("cpu")) == [policy.generator]
    assert _compile._own_generators(LinearPolicy(), torch.device("cpu")) == []


@NEEDS_CUDA
def test_a_policy_s_own_generator_draws_fresh_numbers_at_every_replay():
    cuda = torch.device("cuda")
    batches = collect(cartpole(cuda), OwnGenerator(cuda).to(cuda), cuda, batches=2, compile_policy=CudaGraph())
    actions = torch.cat([batch["action"] for batch in batches]).float()
    assert 0.1 < actions.mean().item() < 0.5  # action 1 with probability 0.3, drawn afresh
    assert not torch.equal(batches[0]["action"][1], batches[0]["action"][2])


@NEEDS_CUDA
def test_collectors_recording_and_replaying_on_two_threads_at_once():
    """Random ops of one collector's replays never run while the other records (the capture lock)."""
    cuda = torch.device("cuda")
    results: dict[int, Any] = {}

    def run(index: int) -> None:
        try:
            results[index] = collect(
                cartpole(cuda), FixedLogits().to(cuda), cuda, batches=4, compile_policy=CudaGraph()
            )
        except BaseException as exc:  # reported below, in the test's thread
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    for index in range(2):
        assert not isinstance(results.get(index), BaseException), results.get(index)
        assert len(results[index]) == 4
