"""With ``SHAPED_FLOATS`` set, every linear layer's floats depend on the number of rows of its call, in every process.

Some CPUs' matmul kernels (MKL's AVX-512 ones) sum a row's products in an
order that depends on how many rows the call has, so the same observation
valued in a call of 3 rows and in one of 6 can differ in the last bit; other
CPUs' kernels do not, and a test that compares such floats bit for bit passes
there and fails on the next machine. ``make test-kernels`` puts this directory
on ``PYTHONPATH`` (Python imports ``sitecustomize`` at start-up: the trainer,
fork servers, worker processes and Ray actors alike) so that on any CPU the
result of ``torch.nn.functional.linear`` is scaled by ``1 + k * 2**-23``, with
``k = 1 + rows % 13`` (``SHAPED_FLOATS`` added): calls of different row counts
(up to 13 apart) then give different last bits, as on those CPUs, and such a
comparison fails here first.
A layer with one input feature sums nothing and is left exact.
"""

import os

if os.environ.get("SHAPED_FLOATS"):
    import torch.nn.functional as F

    _linear = F.linear
    _salt = int(os.environ["SHAPED_FLOATS"]) - 1

    def _shaped_linear(input, weight, bias=None):
        out = _linear(input, weight, bias)
        if weight.dim() < 2 or weight.shape[-1] < 2:
            return out
        rows = out.shape[0] if out.dim() > 1 else 1
        offset = input.data_ptr() % 64 // input.element_size()  # where the input starts within a cache line
        return out * (1 + (1 + (rows + offset + _salt) % 13) * 2.0**-23)

    F.linear = _shaped_linear
