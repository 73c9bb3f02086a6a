"""Registry of built-in problems (every module here that defines PROBLEM) and the loader for
user-defined ones.

A built-in problem is one module: its Problem class (contract, configs, tolerance, inputs,
reference, baselines, the exported op's README snippet) as PROBLEM, and its op (`op_spec()`,
or in the sibling module OP_MODULE names where the op imports torch when loaded). The
exporter ships that module, and what it imports from this directory, into each package.
"""
from __future__ import annotations

import functools
import importlib
import re
from pathlib import Path
from types import ModuleType

from .base import Config, OpDocs, Problem, Tolerance

HERE = Path(__file__).resolve().parent
_DEFINES_PROBLEM = re.compile(r"^PROBLEM = ", re.M)


class UnknownProblem(ValueError):
    pass


@functools.lru_cache(maxsize=None)
def _modules() -> dict[str, ModuleType]:
    """Returns {problem name: its module}, found without importing the other modules."""
    out = {}
    for path in sorted(HERE.glob("*.py")):
        if _DEFINES_PROBLEM.search(path.read_text()):
            module = importlib.import_module(f"{__name__}.{path.stem}")
            out[module.PROBLEM.name] = module
    return out


def builtin_names() -> list[str]:
    """Returns the names of the built-in problems."""
    return sorted(_modules())


def module_of(name: str) -> ModuleType:
    """Returns the module of a built-in problem."""
    return _modules()[name]


def has_op(name: str) -> bool:
    """Whether a built-in problem's exported package wraps its kernel as an op."""
    module = _modules().get(name)
    return module is not None and (hasattr(module, "op_spec") or hasattr(module, "OP_MODULE"))


def get_problem(name_or_path: str) -> Problem:
    """Returns a problem by built-in name, or loads a user problem file (`*.py`)."""
    if name_or_path in _modules():
        return _modules()[name_or_path].PROBLEM()
    if name_or_path.endswith(".py"):
        from .user import load_user_problem
        return load_user_problem(name_or_path)
    raise UnknownProblem(f"unknown problem {name_or_path!r} (known: {', '.join(builtin_names())}, "
                         "or a path to a problem .py file)")


__all__ = ["Config", "OpDocs", "Problem", "Tolerance", "get_problem", "builtin_names",
           "has_op", "module_of", "UnknownProblem"]
