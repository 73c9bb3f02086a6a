"""The tool's own faults (never a candidate's: those are `Verdict`s).

    EvoattnError
    ├── UsageError          bad input from the user: file, key, value
    │   └── ConfigError     a config file key is unknown, mistyped or missing
    ├── RunDirError         a run directory is missing, locked or from another config
    ├── LlmError            the LLM endpoint failed after retries
    │   └── LlmUnavailable  calls keep failing, or the endpoint refuses the key or model:
    │                       the search stops cleanly (exit 1) and the run can be resumed
    ├── ClusterError        the Dask scheduler cannot be reached, or went away mid-run
    └── BudgetExceeded      the run's cost budget is spent (stops the run cleanly)
    Interrupted             SIGTERM or SIGHUP (a KeyboardInterrupt, as Ctrl-C is)

The CLI catches EvoattnError, prints `Name: message` on one line and exits with the code the
README documents (4 for usage errors, 1 for the rest); an interruption exits 128 + signal.
"""


class EvoattnError(Exception):
    """Base of every error the tool raises on purpose."""


class UsageError(EvoattnError):
    """Bad input from the user."""


class ConfigError(UsageError):
    """A configuration file is malformed (names file and key)."""


class RunDirError(EvoattnError):
    """A run directory cannot be used."""


class LlmError(EvoattnError):
    """The LLM endpoint failed after all retries."""


class ClusterError(EvoattnError):
    """The Dask scheduler cannot be reached, or the connection to it was lost (names it)."""


class LlmUnavailable(LlmError):
    """The LLM cannot serve the run (failed calls in a row, a refused key, an unknown model)."""

    def __init__(self, message: str, usage: object = None) -> None:
        super().__init__(message)
        self.usage = usage             # the LlmUsage of the call that ended it, if one was made


class BudgetExceeded(EvoattnError):
    """The configured LLM cost budget is spent."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C so every `finally` stops its child processes."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum
