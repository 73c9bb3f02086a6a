"""Turns a candidate file into a callable `run(inputs, cfg) -> output` (child process only).

Three forms: a Python/Triton file defining the problem's entry function; a fast
CUDA file (`extern "C"` symbol, built with nvcc, called through ctypes); a
PyTorch-extension CUDA file (built with torch.utils.cpp_extension).

A Python file may also define `prepare`, with the entry's signature: called after the first
call of a call key (every input tensor's shape, strides, dtype and device; the other inputs'
values), it returns a function with the entry's signature that later calls of that key run
instead (or None: they keep the entry). An exported package calls its kernel the same way, so
the evaluator checks and times what a user's calls run.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable

from ..contract import runtime
from ..problems.base import Problem
from ..contract.program import declared_companions

RunFn = Callable[[dict[str, Any], dict[str, Any]], Any]


class LoadFailure(Exception):
    """The candidate could not be built or imported; carries build/load verdict data."""

    def __init__(self, kind: str, reason: str, log: str = "") -> None:
        super().__init__(reason)
        self.kind = kind          # "build", "load", or "compiled" (built; no GPU to run it)
        self.reason = reason
        self.log = log


@dataclasses.dataclass(frozen=True)
class Loaded:
    run: RunFn
    form: str                     # "python", "cuda-fast", "cuda-ext"
    build_log: str = ""
    build_cached: bool | None = None
    build_seconds: float | None = None


def build_candidate(path: Path, problem: Problem, cache_dir: Path, build_timeout_s: float,
                    arch: str | None, facts: dict[str, str] | None = None
                    ) -> Callable[[], Loaded]:
    """Builds a CUDA candidate, or a Python candidate's CUDA companions, now (before
    sandboxing); returns a loader to call after."""
    source = path.read_text(errors="replace")   # bad bytes are nvcc's to report, not a crash
    headers = companion_headers(path, source)
    import torch
    has_gpu = torch.cuda.is_available()
    arch = arch or (runtime.detect_arch() if has_gpu else "sm_90a")
    if path.suffix == ".py":
        target = None
        if has_gpu:
            target = runtime.target_fact(runtime.arch_for(*torch.cuda.get_device_capability()))
        libraries, log, cached, seconds = build_companions(path, source, cache_dir,
                                                           build_timeout_s, arch, target, facts)
        return lambda: _load_python(path, problem, libraries, log, cached, seconds)
    form = runtime.cuda_form(source)
    if form == "cuda-fast":
        if not problem.cuda_symbol:
            raise LoadFailure("load", f"problem {problem.name} has no fast CUDA form")
        if problem.cuda_symbol not in source:
            raise LoadFailure("load", f"{path.name}: no extern \"C\" function "
                                      f"{problem.cuda_symbol} (see the README's CUDA contract)")
        res = runtime.build_fast(path, cache_dir, arch, build_timeout_s, extra_files=headers)
    else:
        res = runtime.build_extension(path, cache_dir, arch, build_timeout_s)
    if not res.ok:
        raise LoadFailure("build", _first_error(res.log) or "build failed", res.log)

    def load() -> Loaded:
        if not has_gpu:
            raise LoadFailure("compiled", f"{path.name}: compiled for {arch} "
                              f"({'cached' if res.cached else 'built'}), but CUDA candidates "
                              "need a GPU to run", res.log)
        if form == "cuda-fast":
            try:
                cfn = runtime.load_fast(res.path, problem.cuda_symbol)
            except runtime.LoadError as e:
                raise LoadFailure("load", f"{path.name}: {e}") from None
            run = _fast_runner(cfn, problem)
        else:
            try:
                mod = runtime.load_extension(res.path)
            except Exception as e:  # noqa: BLE001 - a candidate's failure is data
                raise LoadFailure("load", f"extension failed to load: {e}") from None
            fn = getattr(mod, "attention", None)
            if fn is None:
                raise LoadFailure("load", f"{path.name}: extension defines no attention()")
            run = lambda inputs, cfg: problem.call(  # noqa: E731
                lambda q, k, v, causal=False, scale=None: fn(q, k, v, bool(causal), float(scale)),
                inputs, cfg)
        return Loaded(run=run, form=form, build_log=res.log, build_cached=res.cached,
                      build_seconds=res.seconds)

    return load


def companion_headers(path: Path, source: str) -> dict[str, bytes]:
    """Returns the header files (by name) a main file declares as companions, read beside it."""
    return runtime.header_files(path.parent, (c.name for c in declared_companions(source)))


def build_companions(path: Path, source: str, cache_dir: Path, timeout_s: float, arch: str,
                     target: str | None, facts: dict[str, str] | None = None
                     ) -> tuple[dict[str, str], str, bool | None, float | None]:
    """Builds the `.cu` companions a Python main file declares, where their conditions hold for
    the GPU `target` ("sm90"; None: no GPU, nothing could run them, nothing is built) and the
    main file's knob values; returns {name: library path}, the log, cached?, seconds."""
    from ..contract.knobs import find_knobs, values_of
    if target is None:
        return {}, "", None, None
    facts = {"target": target, **(facts or {})}
    values = values_of(find_knobs(source))
    headers = companion_headers(path, source)
    libraries, logs, cached, seconds = {}, [], True, 0.0
    companions = ((c.name, c.when) for c in declared_companions(source))
    for name in runtime.cuda_companions(companions, values, facts):
        res = runtime.build_fast(path.parent / name, cache_dir, arch, timeout_s,
                                 extra_files=headers)
        logs.append(f"[{name}] {res.log}".strip())
        if not res.ok:
            raise LoadFailure("build", f"{name}: " + (_first_error(res.log) or
                                                      "build failed"), res.log)
        libraries[name] = res.path
        cached = cached and res.cached
        seconds += res.seconds
    if not libraries:
        return {}, "", None, None
    return libraries, "\n".join(logs), cached, seconds


def _fast_runner(cfn: Any, problem: Problem) -> RunFn:
    import torch

    def run(inputs: dict[str, Any], cfg: dict[str, Any]) -> Any:
        out = problem.output_like(inputs, cfg)
        stream = torch.cuda.current_stream().cuda_stream
        code = problem.call_cuda(cfn, inputs, cfg, out, stream)
        if code != 0:
            raise RuntimeError(f"{problem.cuda_symbol} returned error code {code}")
        return out

    return run


def _module_name(path: Path) -> str:
    return f"evoattn_candidate_{abs(hash(str(path))) % 10**8}"


def loaded_module(path: Path) -> Any:
    """Returns the module a Python program at `path` was loaded as (None for CUDA files)."""
    return sys.modules.get(_module_name(path))


def _load_python(path: Path, problem: Problem, libraries: dict[str, str], log: str,
                 cached: bool | None, seconds: float | None) -> Loaded:
    name = _module_name(path)
    try:
        mod = runtime.import_main(path, name, libraries)
    except runtime.LoadError as e:
        raise LoadFailure("load", str(e)) from None
    except SyntaxError as e:
        raise LoadFailure("load", f"{path.name}:{e.lineno}: syntax error: {e.msg}") from None
    except BaseException as e:  # noqa: BLE001 - includes SystemExit from a candidate
        raise LoadFailure("load", f"{path.name}: raised at import: "
                                  f"{type(e).__name__}: {e}") from None
    fn = getattr(mod, problem.entry, None)
    if not callable(fn):
        raise LoadFailure("load", f"{path.name}: defines no function {problem.entry}()")
    prepare = getattr(mod, "prepare", None)
    run = _prepared_runner(fn, prepare, problem) if callable(prepare) else \
        (lambda inputs, cfg: problem.call(fn, inputs, cfg))
    return Loaded(run=run, form="python", build_log=log, build_cached=cached,
                  build_seconds=seconds)


def _prepared_runner(fn: Callable[..., Any], prepare: Callable[..., Any],
                     problem: Problem) -> RunFn:
    """run(inputs, cfg) through what `prepare` returns per call key (see the module's doc)."""
    import torch
    tensor = torch.Tensor
    table: dict[tuple, Callable[..., Any]] = {}

    def run(inputs: dict[str, Any], cfg: dict[str, Any]) -> Any:
        try:
            key = (tuple((v.shape, v.stride(), v.dtype, v.device) if isinstance(v, tensor) else v
                         for v in inputs.values()), tuple(cfg.items()))
            go = table.get(key)
        except TypeError:                      # an unhashable input value: no key, the entry
            return problem.call(fn, inputs, cfg)
        if go is not None:
            return problem.call(go, inputs, cfg)
        out = problem.call(fn, inputs, cfg)
        got = problem.call(prepare, inputs, cfg)
        table[key] = got if callable(got) else fn
        return out
    return run


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line.lower():
            return line.strip()[:300]
    return ""
