"""A linear layer whose rows do not depend on how many rows a call has: for tests that compare batches bit for bit."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RowwiseLinear"]


class RowwiseLinear(nn.Linear):
    """``nn.Linear`` computed one input feature at a time with elementwise ops, the same floats on any CPU.

    A matmul kernel may sum a row's products in an order that depends on the
    call's row count (MKL's AVX-512 kernels do): a worker's share, a bootstrap
    call on the ended envs and the thread's call on every env then give the
    same row's value with a different last bit. Elementwise products and sums
    round each row alone, in this fixed order, so tests that compare placements
    or value calls bit for bit compare the collector's plumbing, not the CPU's
    kernels.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bias.expand(*x.shape[:-1], self.out_features)
        for i in range(self.in_features):
            out = out + x[..., i : i + 1] * self.weight[:, i]
        return out
