"""``make test-kernels`` runs its files with shaped floats: a linear layer's last bits depend on the call's rows."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn


@pytest.mark.skipif(not os.environ.get("SHAPED_FLOATS"), reason="only under make test-kernels (SHAPED_FLOATS set)")
def test_a_row_valued_in_calls_of_other_sizes_differs_in_its_last_bits():
    """The same rows valued in a call of 6 and in one of 3 differ, as on MKL's AVX-512 kernels: a test that
    compares such floats bit for bit fails here. Were tests/shaped_floats not on PYTHONPATH, this would fail."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 1)
    x = torch.randn(6, 4)
    with torch.no_grad():
        assert not torch.equal(layer(x)[:3], layer(x[:3].clone()))
        torch.testing.assert_close(layer(x)[:3], layer(x[:3].clone()))
