"""Looking up a problem for the orchestrator: its metadata only, errors as UsageError."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import UsageError


def load_problem(name: str, where: str = "") -> Any:
    """Returns the problem named `name` (built-in, or a problem .py file); one-line errors.

    `where` prefixes the message (e.g. "problem: " for the config key).
    """
    from evoattn.problems import UnknownProblem, get_problem
    if name.endswith(".py") and not Path(name).is_file():
        raise UsageError(f"{where}{name}: problem file not found")
    try:
        return get_problem(name)
    except UnknownProblem as e:
        raise UsageError(f"{where}{e}") from None
    except Exception as e:  # noqa: BLE001 - a user problem file that fails to load
        raise UsageError(f"{where}{name}: cannot load problem: {type(e).__name__}: {e}") from None
