"""The problem contract: what a candidate computes, how it is checked, timed and counted.

A problem is plain metadata (name, configs, contract text) that the orchestrator
may read without CUDA, plus tensor functions that only the evaluator's child
process calls. References and tolerance probes are computed by the child
*before* the candidate is imported, so a candidate cannot tamper with them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

try:
    from ..contract.request import DTYPES
except ImportError:      # shipped into an exported package (no evaluator): it reads no dtypes
    DTYPES = ()

Config = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class OpDocs:
    """How an exported package's README shows the op of a problem."""

    call: str                          # attention(q, k, v, causal=True)
    replaces: str                      # the PyTorch call it stands in for
    shapes: str                        # the inputs' shapes, as a comment above the call
    raw_args: str = "..."              # torch.ops.<ns>.attention(q, k, v, <raw_args>)
    in_module: bool = True             # an nn.Module self-attention example applies
    hf_declines: str = "a padding mask, decoding with a cache"   # calls that run SDPA
    notes: str = ""                    # a paragraph after the transformers section


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Pass rule: err <= factor * (torch's own error in the dtype) + floor, or a fixed max_abs."""

    factor: float = 2.0
    floor: float = 1e-5
    max_abs: float | None = None       # when set, replaces the relative rule

    def bound(self, torch_err: float) -> float:
        if self.max_abs is not None:
            return self.max_abs
        return self.factor * torch_err + self.floor


class Problem:
    """Base class: subclasses fill in the metadata and the tensor functions."""

    name: str = ""
    summary: str = ""                  # one line for `evoattn problems`
    contract: str = ""                 # the full statement, shown to users and LLMs
    entry: str = "attention"           # the Python function a .py candidate defines
    cuda_symbol: str | None = None     # the extern "C" symbol of the fast .cu form
    cuda_signature: str = ""
    ext_signature: str = ""
    dtypes: tuple[str, ...] = DTYPES  # the dtypes the problem's reference and baselines take
    default_dtype: str = "float16"
    default_configs: tuple[Config, ...] = ()
    cpu_configs: tuple[Config, ...] = ()
    # Correctness-only shapes from the promised domain, not in the benchmark (odd S, small B*H).
    domain_configs: tuple[Config, ...] = ()
    cpu_domain_configs: tuple[Config, ...] = ()
    domain: str = ""                   # the promised domain, in words
    tolerance: Tolerance = Tolerance()
    implausible_speedup: float = 10.0  # speedups above this are re-verified before promotion
    baseline_name: str = "sdpa"        # what the baselines are, in words (for listings)
    # Names of `baselines()`, readable without torch (the orchestrator checks `baseline: NAME`).
    baseline_names: tuple[str, ...] = ("baseline",)
    op_docs: OpDocs | None = None      # the exported op's README snippet (None: no op form)
    no_op_reason: str = ""             # why an export of this problem has no op, in words

    # ---- metadata -------------------------------------------------------
    def label(self, cfg: Config) -> str:
        """Returns a short human label for a config."""
        return plain_label(cfg)

    def parse_configs(self, spec: str) -> list[Config]:
        """Parses `--configs` text ('key=val,key=val;...') into configs."""
        out: list[Config] = []
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            cfg: Config = {}
            for kv in part.split(","):
                if "=" not in kv:
                    raise ValueError(f"config {part!r}: expected key=value pairs")
                k, v = kv.split("=", 1)
                cfg[k.strip()] = _parse_scalar(v.strip())
            out.append(cfg)
        return out

    def flops(self, cfg: Config) -> float:
        """Returns the FLOP count used for TFLOP/s."""
        raise NotImplementedError

    def bytes_moved(self, cfg: Config, elem_bytes: int = 2) -> float | None:
        """Returns the least bytes a call must read and write (for GB/s), where the problem is
        bandwidth-bound and says so; None otherwise."""
        return None

    # ---- tensor functions (child process only) --------------------------
    def make_inputs(self, cfg: Config, dtype: Any, device: Any, gen: Any) -> dict[str, Any]:
        """Returns fresh random inputs (tensors and scalars) for one trial."""
        raise NotImplementedError

    def reference(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """Returns the float32 reference output."""
        raise NotImplementedError

    def torch_in_dtype(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """Returns PyTorch's own answer in the candidate's dtype (sets the tolerance)."""
        return self.baseline(inputs, cfg)

    def baseline(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """Returns PyTorch's best implementation's output (timed against the candidate)."""
        raise NotImplementedError

    def baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        """Returns what a PyTorch user could use instead, by name: each is timed side by side
        with the candidate, and fitness takes the fastest (or the one the run names)."""
        return {"baseline": self.baseline}

    def skipped_baselines(self) -> dict[str, str]:
        """Returns {name: why} for baselines of `baseline_names` that cannot run here (a
        library that is not installed), so a listing can name them instead of omitting them."""
        return {}

    def extra_baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        """Returns diagnostic implementations (SDPA backends, naive) timed with --all-backends."""
        return {}

    def call(self, fn: Callable[..., Any], inputs: dict[str, Any], cfg: Config) -> Any:
        """Calls a Python-form candidate entry point on the inputs."""
        raise NotImplementedError

    def call_cuda(self, cfn: Callable[..., int], inputs: dict[str, Any], cfg: Config,
                  out: Any, stream: int) -> int:
        """Calls the fast-form extern "C" function; returns its status code."""
        raise NotImplementedError(f"problem {self.name} has no fast CUDA form")

    def output_like(self, inputs: dict[str, Any], cfg: Config) -> Any:
        """Returns an uninitialised output buffer for the fast CUDA form."""
        raise NotImplementedError

    random_inputs: tuple[str, ...] = ("q", "k", "v")   # refilled with fresh values per timed call

    def refill(self, inputs: dict[str, Any], gen: Any) -> None:
        """Refills the random input tensors in place with fresh values (same addresses)."""
        for name in self.random_inputs:
            inputs[name].normal_(generator=gen)

    def input_tensors(self, inputs: dict[str, Any]) -> list[Any]:
        """Returns the tensors a candidate must leave unchanged."""
        import torch
        return [v for v in inputs.values() if isinstance(v, torch.Tensor)]


class BaselineSetProblem(Problem):
    """A problem whose baselines live in one object, `self._base` (its `available()` and
    `skipped()`), built once in the problem's __init__."""

    _base: Any

    def baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        return self._base.available()

    def skipped_baselines(self) -> dict[str, str]:
        return self._base.skipped()


def plain_label(cfg: Config) -> str:
    """Returns a config as 'key=value,...', the label of a problem that writes none of its own."""
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def _parse_scalar(text: str) -> Any:
    low = text.lower()
    if low in ("true", "yes", "c", "causal"):
        return True
    if low in ("false", "no", "nc"):
        return False
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text
