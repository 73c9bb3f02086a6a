"""Registry of built-in problems and the loader for user-defined ones."""
from __future__ import annotations

from .base import Config, Problem, Tolerance
from .decode import Decode
from .gqa import Gqa
from .masked import Masked
from .mha import Mha
from .model_decode import ModelDecode
from .model_prefill import ModelPrefill
from .sdpa import Sdpa
from .sliding_window import SlidingWindow
from .strided import Strided

_BUILTIN: dict[str, type[Problem]] = {p.name: p for p in (Sdpa, Mha, Strided, Masked, Gqa,
                                                           SlidingWindow, Decode, ModelPrefill,
                                                           ModelDecode)}


class UnknownProblem(ValueError):
    pass


def builtin_names() -> list[str]:
    """Returns the names of the built-in problems."""
    return sorted(_BUILTIN)


def get_problem(name_or_path: str) -> Problem:
    """Returns a problem by built-in name, or loads a user problem file (`*.py`)."""
    if name_or_path in _BUILTIN:
        return _BUILTIN[name_or_path]()
    if name_or_path.endswith(".py"):
        from .user import load_user_problem
        return load_user_problem(name_or_path)
    raise UnknownProblem(f"unknown problem {name_or_path!r} (known: {', '.join(builtin_names())}, "
                         "or a path to a problem .py file)")


__all__ = ["Config", "Problem", "Tolerance", "get_problem", "builtin_names", "UnknownProblem"]
