"""The output comparison every check and re-check uses: max |out - ref| in float32."""
from __future__ import annotations

import math

import torch

from evoattn.child.checks import max_abs_err


def test_a_half_output_is_compared_in_float32() -> None:
    ref = torch.randn(64, 32)
    out = (ref + 1e-3 * torch.randn(64, 32)).half()
    assert max_abs_err(out, ref) == (out.float() - ref).abs().max().item()
    big = torch.full((4,), 60000.0, dtype=torch.half)    # 120000 overflows float16
    assert max_abs_err(big, (-big).float()) == 120000.0


def test_nan_or_inf_in_the_output_is_an_infinite_error() -> None:
    ref = torch.zeros(3, 5)
    for bad in (float("nan"), float("inf"), float("-inf")):
        out = torch.zeros(3, 5, dtype=torch.bfloat16)
        out[1, 2] = bad
        assert max_abs_err(out, ref) == math.inf
    assert max_abs_err(torch.empty(0, 4), torch.empty(0, 4)) == 0.0
