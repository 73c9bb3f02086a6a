"""Loads a user-defined problem from a Python file (`--problem path/to/problem.py`).

The file is trusted exactly like the harness: it defines the reference the candidates
are judged against, and it runs in the orchestrator (for its metadata) and in the
evaluator's child before any candidate code. Keep tensor work inside the functions:
the orchestrator imports the file but never calls them.

Module-level names (see examples/README.md for a worked example):
  required
    NAME            str                    the problem's name (shown in results)
    CONTRACT        str                    what a candidate must compute, for users and LLMs
    CONFIGS         list[dict]             the benchmark configs on a GPU
    make_inputs(cfg, dtype, device, gen) -> dict   fresh inputs for one trial (use gen)
    reference(inputs, cfg) -> Tensor       the float32 reference output
    baseline(inputs, cfg) -> Tensor        PyTorch's best, in the inputs' dtype (timed)
    call(fn, inputs, cfg) -> Tensor        calls the candidate's entry point on the inputs
    flops(cfg) -> float                    FLOPs of one call, for TFLOP/s
  optional
    SUMMARY         str                    one line (default: CONTRACT's first sentence)
    CPU_CONFIGS     list[dict]             small configs for CPU runs (default: CONFIGS)
    DOMAIN_CONFIGS, CPU_DOMAIN_CONFIGS  list[dict]  correctness-only shapes (default: none)
    TOLERANCE       dict                   keys factor, floor, max_abs (default: Tolerance's)
    DTYPES          list[str]              among float16, bfloat16, float32 (default: all three)
    DEFAULT_DTYPE   str                    one of DTYPES (default: float16 if listed, else the first)
    ENTRY           str                    the function a candidate defines (default "attention")
    random_inputs   tuple[str, ...]        input names refilled with fresh normal values before
                                           each timed call (default ("q", "k", "v"))
    BASELINE_NAME   str                    what the baseline is (default "baseline")
    extra_baselines() -> dict[str, fn]     diagnostic implementations timed with --all-backends
    mask_mod(inputs, cfg) -> fn(b, h, q_idx, kv_idx) -> bool     the pattern as FlexAttention's
    score_mod(inputs, cfg) -> fn(score, b, h, q_idx, kv_idx)     mods: either one adds a "flex"
                                           baseline (compiled flex_attention on inputs q, k, v
                                           and scale, its BlockMask built once per config)
    torch_in_dtype(inputs, cfg) -> Tensor  PyTorch's answer that sets the tolerance
                                           (default: baseline)
A missing or ill-typed name raises ValueError("<path>: ..."), naming the file and the name.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from ..contract.request import DTYPES
from .base import Config, Problem, Tolerance

_REQUIRED_FUNCS = ("make_inputs", "reference", "baseline", "call", "flops")
_TOL_KEYS = {f.name for f in dataclasses.fields(Tolerance)}


class UserProblem(Problem):
    """A Problem whose metadata and tensor functions come from a user's module."""

    def __init__(self, path: str, mod: Any) -> None:
        self.path = path
        self.mod = mod
        self.name = _get(mod, path, "NAME", str)
        self.contract = _get(mod, path, "CONTRACT", str)
        self.summary = _get(mod, path, "SUMMARY", str,
                            default=self.contract.split(". ")[0].strip())
        self.default_configs = _configs(mod, path, "CONFIGS", required=True)
        self.cpu_configs = _configs(mod, path, "CPU_CONFIGS") or self.default_configs
        self.domain_configs = _configs(mod, path, "DOMAIN_CONFIGS")
        self.cpu_domain_configs = _configs(mod, path, "CPU_DOMAIN_CONFIGS")
        self.tolerance = _tolerance(mod, path)
        dtypes = tuple(_get(mod, path, "DTYPES", (list, tuple), default=DTYPES))
        bad = [d for d in dtypes if d not in DTYPES]
        if not dtypes or bad:
            raise ValueError(f"{path}: DTYPES must list some of {', '.join(DTYPES)}"
                             + (f" (not {', '.join(map(str, bad))})" if bad else ""))
        self.dtypes = dtypes
        self.default_dtype = _get(mod, path, "DEFAULT_DTYPE", str,
                                  default="float16" if "float16" in dtypes else dtypes[0])
        if self.default_dtype not in dtypes:
            raise ValueError(f"{path}: DEFAULT_DTYPE {self.default_dtype!r} is not in DTYPES")
        self.entry = _get(mod, path, "ENTRY", str, default="attention")
        names = _get(mod, path, "random_inputs", (list, tuple), default=("q", "k", "v"))
        if not all(isinstance(n, str) for n in names):
            raise ValueError(f"{path}: random_inputs must be a tuple of input names (str)")
        self.random_inputs = tuple(names)
        self.baseline_name = _get(mod, path, "BASELINE_NAME", str, default="baseline")
        self.domain = _get(mod, path, "DOMAIN", str, default="")
        for fname in _REQUIRED_FUNCS:
            _func(mod, path, fname)
        for fname in ("extra_baselines", "torch_in_dtype", "mask_mod", "score_mod"):
            if hasattr(mod, fname):
                _func(mod, path, fname)
        self._flex = None
        if hasattr(mod, "mask_mod") or hasattr(mod, "score_mod"):
            from .flex import FlexBaseline
            self._flex = FlexBaseline(self._flex_pattern, self.random_inputs)
        self.baseline_names = ("baseline",) + (("flex",) if self._flex else ())

    def flops(self, cfg: Config) -> float:
        return float(self.mod.flops(cfg))

    def make_inputs(self, cfg: Config, dtype: Any, device: Any, gen: Any) -> dict[str, Any]:
        inputs = self.mod.make_inputs(cfg, dtype, device, gen)
        if not isinstance(inputs, dict):
            raise ValueError(f"{self.path}: make_inputs returned {type(inputs).__name__}, "
                             "not a dict")
        missing = [n for n in self.random_inputs if n not in inputs]
        if missing:
            raise ValueError(f"{self.path}: make_inputs has no input {', '.join(missing)} "
                             "named in random_inputs")
        return inputs

    def reference(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return self.mod.reference(inputs, cfg).float()

    def torch_in_dtype(self, inputs: dict[str, Any], cfg: Config) -> Any:
        if hasattr(self.mod, "torch_in_dtype"):
            return self.mod.torch_in_dtype(inputs, cfg)
        return self.baseline(inputs, cfg)

    def baseline(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return self.mod.baseline(inputs, cfg)

    def baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        return {"baseline": self.baseline, **({"flex": self._flex} if self._flex else {})}

    def _flex_pattern(self, inputs: dict[str, Any], cfg: Config) -> Any:
        from .flex import FlexPattern
        q, k = inputs["q"], inputs["k"]
        mods = {n: getattr(self.mod, n)(inputs, cfg) if hasattr(self.mod, n) else None
                for n in ("mask_mod", "score_mod")}
        return FlexPattern(mods["mask_mod"], mods["score_mod"], None, None, q.shape[2],
                           k.shape[2])

    def extra_baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        if not hasattr(self.mod, "extra_baselines"):
            return {}
        extra = self.mod.extra_baselines()
        if not isinstance(extra, dict):
            raise ValueError(f"{self.path}: extra_baselines() must return a dict name -> function")
        return extra

    def call(self, fn: Callable[..., Any], inputs: dict[str, Any], cfg: Config) -> Any:
        return self.mod.call(fn, inputs, cfg)


def load_user_problem(path: str) -> Problem:
    """Imports a problem file and returns it as a Problem; ValueError names the file and name."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: problem file not found")
    name = f"evoattn_user_problem_{abs(hash(str(p.resolve()))) % 10**8}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: cannot be imported as a Python module")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except SyntaxError as e:
        raise ValueError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - report the user's import error as one line
        raise ValueError(f"{path}: raised at import: {type(e).__name__}: {e}") from None
    return UserProblem(path, mod)


_MISSING = object()


def _get(mod: Any, path: str, name: str, types: Any, default: Any = _MISSING) -> Any:
    if not hasattr(mod, name):
        if default is _MISSING:
            raise ValueError(f"{path}: missing required name {name}")
        return default
    value = getattr(mod, name)
    if not isinstance(value, types):
        want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise ValueError(f"{path}: {name} must be a {want}, got {type(value).__name__}")
    return value


def _func(mod: Any, path: str, name: str) -> Callable[..., Any]:
    if not hasattr(mod, name):
        raise ValueError(f"{path}: missing required function {name}()")
    fn = getattr(mod, name)
    if not callable(fn):
        raise ValueError(f"{path}: {name} must be a function, got {type(fn).__name__}")
    return fn


def _configs(mod: Any, path: str, name: str, required: bool = False) -> tuple[Config, ...]:
    value = _get(mod, path, name, (list, tuple), default=_MISSING if required else ())
    if required and not value:
        raise ValueError(f"{path}: {name} must list at least one config")
    for i, c in enumerate(value):
        if not isinstance(c, dict):
            raise ValueError(f"{path}: {name}[{i}] must be a dict, got {type(c).__name__}")
    return tuple(dict(c) for c in value)


def _tolerance(mod: Any, path: str) -> Tolerance:
    tol = _get(mod, path, "TOLERANCE", dict, default={})
    unknown = sorted(set(tol) - _TOL_KEYS)
    if unknown:
        raise ValueError(f"{path}: TOLERANCE has unknown key {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(_TOL_KEYS))})")
    try:
        return Tolerance(**{k: None if v is None and k == "max_abs" else float(v)
                            for k, v in tol.items()})
    except (TypeError, ValueError):
        raise ValueError(f"{path}: TOLERANCE values must be numbers") from None
