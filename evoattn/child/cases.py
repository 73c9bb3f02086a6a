"""Preparing the checked cases: fresh secret inputs, float32 references, tolerance probes.

Everything here runs before the candidate is imported. The tolerance of a config is
`factor × (PyTorch's own error in the dtype) + floor`; PyTorch's answer for that probe comes
from SDPA's FlashAttention, memory-efficient or math backends, never cuDNN: cuDNN builds an
execution plan per new shape (about 0.1 s each, 0.9 s for the first, measured on an H100),
which would cost every candidate seconds, and its error is of the same size.
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
from typing import Any, Iterator

from . import checks
from ..problems.base import Problem, Tolerance


@dataclasses.dataclass
class Trial:
    """One set of inputs and its float32 reference."""

    inputs: dict[str, Any]
    ref: Any


@dataclasses.dataclass
class Case:
    """One config to check (and, unless a domain shape, to time)."""

    cfg: dict[str, Any]
    label: str
    domain: bool                        # a correctness-only shape from the promised domain
    trials: list[Trial]
    gen: Any                            # the config's torch.Generator (secretly seeded)
    torch_err: float                    # PyTorch's worst error in the dtype over the trials
    bound: float                        # the tolerance: what an error may reach
    out_bytes: int
    like: Any                           # a meta tensor shaped like the expected output


@contextlib.contextmanager
def probe_backends(on_gpu: bool) -> Iterator[None]:
    """Keeps SDPA off cuDNN for tolerance probes (see the module docstring)."""
    if not on_gpu:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH]):
        yield


def prepare_case(problem: Problem, cfg: dict[str, Any], domain: bool, dtype: Any, device: Any,
                 rng: random.Random, trials: int, tol: Tolerance) -> Case:
    """Draws `trials` input sets and computes their references and PyTorch's own error."""
    import torch
    gen = torch.Generator(device=device)
    made: list[Trial] = []
    worst = 0.0
    out_bytes, like = 0, None
    for _ in range(trials):
        gen.manual_seed(rng.getrandbits(62))
        inputs = problem.make_inputs(cfg, dtype, device, gen)
        ref = problem.reference(inputs, cfg)
        with probe_backends(device.type == "cuda"):
            probe = problem.torch_in_dtype(inputs, cfg)
        worst = max(worst, checks.max_abs_err(probe, ref))
        made.append(Trial(inputs, ref))
        out_bytes = probe.numel() * probe.element_size()
        like = torch.empty_like(probe, device="meta")
        del probe
    label = problem.label(cfg) + (" [domain shape]" if domain else "")
    return Case(cfg, label, domain, made, gen, worst, tol.bound(worst), out_bytes, like)


def fresh_bound(problem: Problem, case: Case, inputs: dict[str, Any], ref: Any,
                tol: Tolerance) -> float:
    """Returns the tolerance on new inputs: PyTorch's own error on them counts too."""
    with probe_backends(ref.device.type == "cuda"):
        probe = problem.torch_in_dtype(inputs, case.cfg)
    return tol.bound(max(case.torch_err, checks.max_abs_err(probe, ref)))
