"""Class 8 (harness tampering): rebinds `evoattn.child.checking.checks` to a forgiving stand-in.

`evoattn.child.checks.max_abs_err` itself stays untouched; the check stage calls it through its
module global `checks`, which now says 0.0. Returns zeros, which only pass if it is believed."""
import types

import torch

import evoattn.child.checks
import evoattn.child.checking

_real = evoattn.child.checks
evoattn.child.checking.checks = types.SimpleNamespace(
    output_problem=_real.output_problem,
    inputs_changed=_real.inputs_changed, max_abs_err=lambda out, ref: 0.0)


def attention(q, k, v, causal=False, scale=None):
    return torch.zeros_like(q)
