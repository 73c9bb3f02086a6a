"""The op's spec for this package's kernel: its problem module's, shipped in `_problems/`.

A built-in problem's module (or the sibling its OP_MODULE names) says how the op is declared,
checked, run on the kernel and on SDPA (`op_spec()`); a user-defined problem's schema comes
from the kernel's entry signature (kernel.json), and it has no fallback.
"""
from __future__ import annotations

import importlib
from typing import Any

from ._problems.op import Args, OpSpec, Param, parse_schema, user_spec

__all__ = ["Args", "OpSpec", "Param", "parse_schema", "spec_for"]


def spec_for(meta: dict[str, Any]) -> OpSpec | None:
    """Returns the op spec of an export's problem (None: the problem has no op form)."""
    if meta["user_problem"]:
        return user_spec(meta["schema"]) if meta["schema"] else None
    module = importlib.import_module(f"._problems.{meta['problem_module']}", __package__)
    home = getattr(module, "OP_MODULE", None)
    if home is not None:
        module = importlib.import_module(f"._problems.{home}", __package__)
    make = getattr(module, "op_spec", None)
    return make() if make is not None else None
