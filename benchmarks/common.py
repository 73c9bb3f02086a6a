"""What the benchmarks share: interleaved rounds, host cost, eager loops, config labels,
geometric means and loading a trusted program (the timing loops are the evaluator's where it
has them)."""
from __future__ import annotations

import functools
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from evoattn.contract import program, runtime
from evoattn.contract.knobs import set_knobs
from evoattn.child.loader import build_companions
from evoattn.problems import get_problem
from evoattn.problems.base import Problem
from evoattn.child.timing import Plan, adapt
from evoattn.contract.types import geometric_mean
from evoattn.mutators.knobs import parse_settings

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def sync() -> None:
    """Waits for the GPU, where there is one."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved_samples(fns: dict[str, Any], measure: Callable[[Any], T],
                        rounds: int = 5) -> dict[str, list[T]]:
    """Returns each function's `rounds` measurements, taken in the evaluator's interleaved
    rounds (the order reversed every round), so a drift in the host's or the GPU's speed
    falls on all."""
    plan = Plan(warmup=0, reps=rounds, rounds=rounds, graph_rounds=rounds, sets=2,
                graph=False, mode="call")

    def one_round(_: int, order: list[str], samples: dict[str, list[Any]]) -> None:
        for name in order:
            samples[name].append(measure(fns[name]))
    return adapt("call", list(fns), plan, lambda mode, samples: False, one_round)


def interleaved(fns: dict[str, Any], measure: Callable[[Any], float],
                rounds: int = 5) -> dict[str, float]:
    """Returns the median of each function's interleaved_samples."""
    return {name: statistics.median(x)
            for name, x in interleaved_samples(fns, measure, rounds).items()}


@functools.lru_cache(maxsize=None)
def _gpu_timer() -> Any:
    from evoattn.child.timing import GpuTimer
    return GpuTimer(tempfile.mkdtemp(prefix="evoattn-bench-"))


def host_us(fn: Callable[[], Any]) -> float:
    """Returns the median host time of one call (µs) while a sleep kernel holds the GPU, by
    the evaluator's own host_us measurement."""
    for _ in range(3):
        fn()
    return _gpu_timer()._host_us(lambda _inputs: fn(), {}, 0.0)


def eager_ms(fn_on: Callable[[Any], Any], sets: list[Any], rounds: int = 7) -> float:
    """Returns the median per-call time (ms) of back-to-back calls, one per input set, between
    two syncs (a first round warms up)."""
    out = []
    for _ in range(rounds + 1):
        sync()
        t0 = time.perf_counter()
        for s in sets:
            fn_on(s)
        sync()
        out.append((time.perf_counter() - t0) / len(sets) * 1e3)
    return statistics.median(out[1:])


def geomean(xs: Iterable[float | None]) -> float | None:
    """Returns the geometric mean of the values present (None and 0 left out), None if none."""
    return geometric_mean([x for x in xs if x]) or None


@functools.lru_cache(maxsize=None)
def _problem(name: str) -> Problem:
    try:
        return get_problem(name)
    except ValueError:                  # unknown, or a problem file that is not here
        return Problem()                 # the plain label


def label(problem: str | Problem, cfg: dict[str, Any]) -> str:
    """Returns a config's label as its problem writes it (a name or a problem file)."""
    return (_problem(problem) if isinstance(problem, str) else problem).label(cfg)


def load_module(path: Path, name: str, libraries: dict[str, Any] | None = None) -> Any:
    """Imports a trusted file as module `name`, its built companions set first."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: cannot import")
    mod = importlib.util.module_from_spec(spec)
    if libraries is not None:
        mod.EVOATTN_LIBRARIES = libraries
    spec.loader.exec_module(mod)
    return mod


def load_program(path: Path, sets: list[str], tmp: Path, name: str) -> tuple[Any, dict[str, Any]]:
    """Returns a trusted program imported with its knobs set and its CUDA companions built as
    the evaluator builds them, and the companions built."""
    import torch
    source = program.read(path)
    if sets:
        source = set_knobs(source, parse_settings(str(path), source, sets))
    tmp.mkdir(parents=True, exist_ok=True)
    main = program.write(source, tmp, path.name)
    major, minor = torch.cuda.get_device_capability()
    libs = build_companions(main, main.read_text(), tmp / "cache", 600, runtime.detect_arch(),
                            f"sm{major}{minor}")[0]
    return load_module(main, name, libs), libs
