"""compute_gae against a float64 reference loop."""

from __future__ import annotations

import re

import pytest
import torch

from torch_rollout import compute_gae


def reference_gae(reward, value, next_value, terminated, truncated, gamma, gae_lambda):
    """The textbook backward loop, in float64."""
    reward, value, next_value = (x.double() for x in (reward, value, next_value))
    terminated = terminated.double()
    done = (terminated.bool() | truncated.bool()).double()
    advantage = torch.zeros_like(value)
    last = torch.zeros_like(value[0])
    for t in reversed(range(value.shape[0])):
        delta = reward[t] + gamma * (1 - terminated[t]) * next_value[t] - value[t]
        last = delta + gamma * gae_lambda * (1 - done[t]) * last
        advantage[t] = last
    return advantage, advantage + value


def random_inputs(shape, done_density, dtype, generator):
    reward = torch.randn(shape, generator=generator).to(dtype)
    value = torch.randn(shape, generator=generator).to(dtype)
    next_value = torch.randn(shape, generator=generator).to(dtype)
    terminated = torch.rand(shape, generator=generator) < done_density
    truncated = torch.rand(shape, generator=generator) < done_density
    return reward, value, next_value, terminated, truncated


@pytest.mark.parametrize("shape", [(1,), (2,), (3, 1), (5, 4), (128, 8), (129, 3, 2), (1000, 7)], ids=str)
@pytest.mark.parametrize("done_density", [0.0, 0.02, 0.3, 1.0])
@pytest.mark.parametrize("gamma, gae_lambda", [(0.99, 0.95), (0.9, 1.0), (1.0, 0.0), (0.0, 0.5), (1.0, 1.0)])
def test_matches_float64_reference(shape, done_density, gamma, gae_lambda):
    generator = torch.Generator().manual_seed(hash((shape, done_density, gamma)) % 2**31)
    inputs = random_inputs(shape, done_density, torch.float32, generator)
    advantage, return_ = compute_gae(*inputs, gamma=gamma, gae_lambda=gae_lambda)
    ref_advantage, ref_return = reference_gae(*inputs, gamma, gae_lambda)
    assert advantage.dtype == torch.float32 and advantage.shape == shape
    # 1e-5 relative to the magnitude of the quantities summed (long sums cancel).
    scale = ref_advantage.abs().max().item() + 1.0
    torch.testing.assert_close(advantage.double(), ref_advantage, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(return_.double(), ref_return, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)]
)
def test_keeps_dtype(dtype, tol):
    generator = torch.Generator().manual_seed(0)
    inputs = random_inputs((64, 4), 0.05, dtype, generator)
    advantage, return_ = compute_gae(*inputs, gamma=0.99, gae_lambda=0.95)
    assert advantage.dtype == dtype and return_.dtype == dtype
    ref_advantage, _ = reference_gae(*inputs, 0.99, 0.95)
    scale = ref_advantage.abs().max().item()
    torch.testing.assert_close(advantage.double(), ref_advantage, rtol=tol, atol=tol * scale)


def test_truncation_bootstraps_and_termination_does_not():
    reward = torch.tensor([1.0, 1.0, 1.0, 1.0])
    value = torch.tensor([0.5, 0.5, 0.5, 0.5])
    next_value = torch.tensor([0.5, 7.0, 0.5, 3.0])
    terminated = torch.tensor([False, False, False, True])
    truncated = torch.tensor([False, True, False, False])
    advantage, return_ = compute_gae(reward, value, next_value, terminated, truncated, gamma=0.5, gae_lambda=1.0)
    # step 1 is truncated: bootstraps from V(final obs) = 7 and does not see step 2.
    assert advantage[1].item() == pytest.approx(1.0 + 0.5 * 7.0 - 0.5)
    # step 3 terminates: no bootstrap from next_value.
    assert advantage[3].item() == pytest.approx(1.0 - 0.5)
    assert advantage[2].item() == pytest.approx(1.0 + 0.5 * 0.5 - 0.5 + 0.5 * advantage[3].item())
    assert advantage[0].item() == pytest.approx(1.0 + 0.5 * 0.5 - 0.5 + 0.5 * advantage[1].item())
    torch.testing.assert_close(return_, advantage + value)


def test_accepts_float_done_flags():
    generator = torch.Generator().manual_seed(1)
    reward, value, next_value, terminated, truncated = random_inputs((50, 3), 0.1, torch.float32, generator)
    expected = compute_gae(reward, value, next_value, terminated, truncated, gamma=0.9, gae_lambda=0.8)
    got = compute_gae(reward, value, next_value, terminated.float(), truncated.float(), gamma=0.9, gae_lambda=0.8)
    torch.testing.assert_close(got, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    generator = torch.Generator().manual_seed(2)
    inputs = random_inputs((2048, 64), 0.01, torch.float32, generator)
    cpu = compute_gae(*inputs, gamma=0.99, gae_lambda=0.95)
    cuda = compute_gae(*(x.cuda() for x in inputs), gamma=0.99, gae_lambda=0.95)
    assert cuda[0].device.type == "cuda"
    torch.testing.assert_close(cuda[0].cpu(), cpu[0], rtol=1e-5, atol=1e-4)


def test_bad_inputs():
    x = torch.zeros(4, 2)
    done = torch.zeros(4, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=re.escape("compute_gae: next_value has shape (4, 3), expected the shape")):
        compute_gae(x, x, torch.zeros(4, 3), done, done, gamma=0.9, gae_lambda=0.9)
    with pytest.raises(ValueError, match=re.escape("compute_gae: gamma must lie in [0, 1], got 1.5")):
        compute_gae(x, x, x, done, done, gamma=1.5, gae_lambda=0.9)
    with pytest.raises(TypeError, match=re.escape("compute_gae: reward must be a torch.Tensor, got list")):
        compute_gae([0.0] * 4, x, x, done, done, gamma=0.9, gae_lambda=0.9)
    with pytest.raises(ValueError, match=re.escape("with T >= 1, got shape (0, 2)")):
        empty = torch.zeros(0, 2)
        compute_gae(empty, empty, empty, empty.bool(), empty.bool(), gamma=0.9, gae_lambda=0.9)
    with pytest.raises(
        TypeError, match=re.escape("compute_gae: value must be a floating-point tensor, got dtype torch.int64")
    ):
        ints = torch.zeros(4, 2, dtype=torch.long)
        compute_gae(x, ints, ints, done, done, gamma=0.9, gae_lambda=0.9)
