"""From a run config or `evoattn eval`'s flags to an evaluation: problem, device, configs, and
the one EvalRequest. `evoattn eval` and `evoattn run` both come through here, so a problem,
a device, a tolerance or a `.cu` file on the CPU means the same under both."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console

from evoattn.contract.request import EvalRequest

from .config import EvaluatorConfig
from .errors import UsageError
from .problem_lookup import load_problem


def problem_ref(name: str, config_path: str | None = None) -> str:
    """Returns a built-in problem name as is, or a problem .py path made absolute (the
    evaluator's child runs elsewhere), found beside the config if it is not found here."""
    if not name.endswith(".py"):
        return name
    return str(locate(name, config_path, "problem file"))


def locate(path: str, config_path: str | None, what: str) -> Path:
    """Returns an existing file: the path itself, else relative to the config's dir or its parent."""
    p = Path(path)
    tries = [p] if p.is_absolute() else [Path.cwd() / p]
    if config_path and not p.is_absolute():
        here = Path(config_path).resolve().parent
        tries += [here / p, here.parent / p]
    for t in tries:
        if t.is_file():
            return t.resolve()
    raise UsageError(f"{what} {path} not found" + (f" (config {config_path})" if config_path else ""))


def problem(ref: str, where: str = "") -> Any:
    """Returns the problem for a reference (UsageError, one line, if it cannot be loaded)."""
    return load_problem(ref, where=where)


def parse_configs(prob: Any, specs: Sequence[str] | str | None,
                  where: str) -> tuple[dict[str, Any], ...] | None:
    """Returns the configs `specs` select ('B,H,S,D[,causal|nc]' or 'key=value,...'), or None."""
    if not specs:
        return None
    items = [specs] if isinstance(specs, str) else list(specs)
    out: list[dict[str, Any]] = []
    for i, spec in enumerate(items):
        try:
            out += prob.parse_configs(spec)
        except ValueError as e:
            label = where if isinstance(specs, str) else f"{where}[{i}]"
            raise UsageError(f"{label}: {e}") from None
    return tuple(out)


def detect_device() -> str:
    """Returns 'cuda' when an NVIDIA GPU is visible (without initialising CUDA here), else 'cpu'."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return "cpu"
    if any(os.path.exists(f"/dev/nvidia{i}") for i in range(16)):
        return "cuda"
    return "cpu"


def resolve_device(device: str | None, here: bool = True) -> str:
    """Returns the device to run on: 'auto' (or None) becomes what detect_device() finds; asking
    for 'cuda' where no GPU is visible is a usage error. With `here` False the evaluations run
    elsewhere (a cluster's GPU workers): 'auto' is 'cuda', and this machine needs no GPU."""
    if not here:
        return "cuda" if device in (None, "auto") else device
    if device in (None, "auto"):
        return detect_device()
    if device == "cuda" and detect_device() != "cuda":
        raise UsageError("--device cuda: no NVIDIA GPU is visible here (no /dev/nvidia*, or "
                         "CUDA_VISIBLE_DEVICES is empty); use --device cpu")
    return device


def cuda_on_cpu(path: Path | str, device: str) -> bool:
    """Returns whether a CUDA program is asked to run where there is no GPU (it can only build)."""
    return Path(path).suffix == ".cu" and device == "cpu"


def cpu_notice(console: Console) -> None:
    """Says, once, what a CPU run measures."""
    console.print("[yellow]CPU mode[/yellow]: no GPU here, so candidates run through Triton's "
                  "interpreter on the problem's small CPU configs; times are CPU timings, not "
                  "GPU performance.")


def run_dtypes(dtypes: Sequence[str] | None, device: str) -> tuple[str, ...] | None:
    """Returns the dtypes a run checks on this device: on the CPU, a config's bfloat16 is left
    to GPU runs when another dtype is listed (PyTorch's CPU attention keeps P in float32 in
    bfloat16, so the tolerance it sets is tighter than any kernel that rounds P can meet)."""
    if not dtypes or device != "cpu" or len(dtypes) < 2:
        return tuple(dtypes) if dtypes else None
    return tuple(d for d in dtypes if d != "bfloat16") or tuple(dtypes)


def eval_request(ref: str, prob: Any, device: str, configs: tuple[dict[str, Any], ...] | None,
                 dtypes: Sequence[str] | None, ev: EvaluatorConfig) -> EvalRequest:
    """Returns the request every candidate of a run (or one `evoattn eval`) is evaluated with:
    checked in every one of `dtypes`, timed in the first (None or empty: the problem's
    default dtype)."""
    if ev.baseline != "best" and ev.baseline not in prob.baseline_names:
        raise UsageError(f"baseline {ev.baseline!r}: problem {prob.name} has the baselines "
                         f"{', '.join(prob.baseline_names)} (or 'best', the fastest)")
    if device == "cpu" and ev.timing == "graph":
        raise UsageError("timing graph: CUDA graphs need a GPU; on the CPU use call or kernel")
    for dtype in dtypes or ():
        if dtype not in prob.dtypes:
            raise UsageError(f"dtype {dtype}: problem {prob.name} supports "
                             f"{', '.join(prob.dtypes)}")
    req = EvalRequest(problem=ref, device=device, configs=configs,
                      dtypes=tuple(dtypes) if dtypes else None, trials=ev.trials,
                      tolerance_factor=ev.tolerance_factor, tolerance_floor=ev.tolerance_floor,
                      max_abs=ev.max_abs, policy=ev.policy, screen=ev.screen, timing=ev.timing,
                      baseline=ev.baseline, all_backends=ev.all_backends, warmup=ev.warmup,
                      reps=ev.reps, build_timeout_s=ev.build_timeout_s,
                      run_timeout_s=ev.run_timeout_s, pin_cpu=ev.pin_cpu)
    try:
        req.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return req


def evaluator_config(**flags: Any) -> EvaluatorConfig:
    """Returns an EvaluatorConfig from CLI flags: those given (not None) replace the defaults."""
    return dataclasses.replace(EvaluatorConfig(), **{k: v for k, v in flags.items()
                                                     if v is not None})
