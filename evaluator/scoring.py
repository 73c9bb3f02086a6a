"""From times to a score: the fitness baseline per config, speedups, TFLOP/s, fitness.

The baseline a speedup is measured against is, by default, the fastest of the problem's
baselines in the timing mode ("best": what a PyTorch user who tried them all would keep);
`baseline: NAME` picks one. Fitness is the geometric mean of the per-config speedups, and 0
unless every config has one.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .types import ConfigResult, Times, geometric_mean


def pick_baseline(policy: str, times: dict[str, Times], mode: str) -> tuple[str, float | None]:
    """Returns (name, ms) of the fitness baseline among timed baselines (ms None if untimed)."""
    if policy != "best":
        t = times.get(policy)
        return policy, (t.in_mode(mode) if t else None)
    timed = [(t.in_mode(mode), name) for name, t in times.items() if t.in_mode(mode)]
    if not timed:
        return "", None
    ms, name = min(timed)
    return name, ms


def tflops(flops: float, ms: float | None) -> float | None:
    """Returns TFLOP/s for a time in ms (None without a positive time)."""
    return flops / (ms * 1e-3) / 1e12 if ms and ms > 0 else None


def score(checked: ConfigResult, cand: Times, baselines: dict[str, Times],
          backends: dict[str, Times], mode: str, policy: str, flops: float,
          peak_tflops: float | None, mem: int | None = None,
          base_mems: dict[str, int | None] | None = None) -> ConfigResult:
    """Returns the checked config with its times, baselines and speedup in `mode`."""
    ms = cand.in_mode(mode)
    name, base_ms = pick_baseline(policy, baselines, mode)
    speed = base_ms / ms if ms and base_ms else None
    flops_per_s = tflops(flops, ms)
    return dataclasses.replace(
        checked, ms=ms, baseline_ms=base_ms, baseline_name=name, tflops=flops_per_s,
        baseline_tflops=tflops(flops, base_ms), speedup=speed,
        frac_peak=flops_per_s / peak_tflops if flops_per_s and peak_tflops else None,
        peak_mem_bytes=mem, baseline_peak_mem_bytes=(base_mems or {}).get(name),
        times=cand, baseline_times=dict(baselines),
        baselines={n: t.in_mode(mode) for n, t in baselines.items() if t.in_mode(mode)},
        backends_ms={n: t.in_mode(mode) for n, t in backends.items() if t.in_mode(mode)})


def fitness(configs: tuple[ConfigResult, ...] | list[ConfigResult]) -> float:
    """Returns the geometric-mean speedup (0 unless every config has one)."""
    return geometric_mean([c.speedup or 0.0 for c in configs])


def rescore(configs: tuple[ConfigResult, ...], mode: str, policy: str,
            flops: Any) -> tuple[tuple[ConfigResult, ...], float]:
    """Returns configs scored again in another mode or baseline policy, and their fitness.

    `flops(params)` gives a config's FLOP count. Used to show one evaluation in every mode.
    """
    out = []
    for c in configs:
        if c.times is None:
            out.append(c)
            continue
        out.append(score(c, c.times, c.baseline_times, {}, mode, policy, flops(c.params),
                         None, c.peak_mem_bytes))
    return tuple(out), fitness(out)
