"""From times to a score: the fitness baseline per config, speedups, TFLOP/s, fitness.

The baseline a speedup is measured against is, by default, the fastest of the problem's
baselines in the timing mode ("best": what a PyTorch user who tried them all would keep);
`baseline: NAME` picks one. Fitness is the geometric mean of the per-config speedups, and 0
unless every config has one.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from . import stats
from .types import ConfigResult, EvalResult, Times, geometric_mean


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


def speedup_ci(cand: Times, base: Times | None, mode: str) -> tuple[float, float] | None:
    """Returns the 95% interval of base / cand in `mode` from each side's own interval (the
    two measured apart)."""
    if base is None or not cand.in_mode(mode) or not base.in_mode(mode):
        return None
    return stats.ratio_of_intervals(base.in_mode(mode), base.ci_in_mode(mode),  # type: ignore[arg-type]
                                    cand.in_mode(mode), cand.ci_in_mode(mode))  # type: ignore[arg-type]


def converged_rule(policy: str, width: float, given: bool, mode: str) -> Any:
    """Returns the timer's stopping rule for one config: in the fitness mode, the candidate's
    speedup over its fitness baseline (and its gain over a rival, in a duel) known within
    `width`; with baseline times given from elsewhere, the candidate's own median within
    width / sqrt 2."""
    def rule(now: str, samples: dict[str, list[float]]) -> bool:
        cand = samples.get("candidate")
        if now != mode or not cand:
            return True
        others = []
        if "rival" in samples:
            others.append(samples["rival"])
        if given:
            if stats.rel_half_width(*stats.center(cand)) > width / 2 ** .5:
                return False
        else:
            base = {n.split(":", 1)[1]: v for n, v in samples.items() if n.startswith("baseline:")}
            if policy != "best" and policy in base:
                others.append(base[policy])
            elif base:
                others.append(min(base.values(),      # the fastest: medians, no bootstrap
                                  key=lambda v: statistics.median(stats.units(v))))
        for other in others:
            point, ci = stats.ratio(other, cand, paired=True)
            if stats.rel_half_width(point, ci) > width:
                return False
        return True
    return rule


def score(checked: ConfigResult, cand: Times, baselines: dict[str, Times],
          backends: dict[str, Times], mode: str, policy: str, flops: float,
          peak_tflops: float | None, mem: int | None = None,
          base_mems: dict[str, int | None] | None = None,
          samples: dict[str, dict[str, list[float]]] | None = None,
          given: bool = False) -> ConfigResult:
    """Returns the checked config with its times, baselines and speedup in `mode`.

    `samples` (mode -> function -> per-round times) makes the speedup the median of the
    rounds' ratios, with a paired interval; without them (or with `given`: the baselines
    were timed in another process) it is baseline_ms / ms."""
    ms = cand.in_mode(mode)
    name, base_ms = pick_baseline(policy, baselines, mode)
    speed = base_ms / ms if ms and base_ms else None
    flops_per_s = tflops(flops, ms)
    by_name = (samples or {}).get(mode, {}) if not given else {}
    base_samples, cand_samples = by_name.get(f"baseline:{name}"), by_name.get("candidate")
    ci = None
    if speed and base_samples and cand_samples:   # timed in the same rounds: paired
        speed, ci = stats.ratio(base_samples, cand_samples, paired=True)
    elif speed:
        ci = speedup_ci(cand, baselines.get(name), mode)
    return dataclasses.replace(
        checked, ms=ms, baseline_ms=base_ms, baseline_name=name, tflops=flops_per_s,
        baseline_tflops=tflops(flops, base_ms), speedup=speed, speedup_ci=ci,
        frac_peak=flops_per_s / peak_tflops if flops_per_s and peak_tflops else None,
        peak_mem_bytes=mem, baseline_peak_mem_bytes=(base_mems or {}).get(name),
        times=cand, baseline_times=dict(baselines),
        baselines={n: t.in_mode(mode) for n, t in baselines.items() if t.in_mode(mode)},
        backends_ms={n: t.in_mode(mode) for n, t in backends.items() if t.in_mode(mode)})


def with_rival(result: ConfigResult, rival: Times, samples: dict[str, dict[str, list[float]]],
               mode: str) -> ConfigResult:
    """Adds a duel's rival times and gain (rival ms / candidate ms, paired interval)."""
    by_name = samples.get(mode, {})
    r, c = by_name.get("rival"), by_name.get("candidate")
    gain, ci = (stats.ratio(r, c, paired=True) if r and c else (None, None))
    return dataclasses.replace(result, rival_times=rival, gain=gain, gain_ci=ci)


def duel_in_mode(configs: tuple[ConfigResult, ...], mode: str, policy: str
                 ) -> tuple[float, float, float | None, tuple[float, float] | None]:
    """Returns a duel's (candidate fitness, rival fitness, gain, gain interval) in any mode,
    from the per-config times in every mode (intervals from each side's own)."""
    cand, rival, gains, cis = [], [], [], []
    for c in configs:
        if c.times is None or c.rival_times is None:
            return 0.0, 0.0, None, None
        _, base = pick_baseline(policy, c.baseline_times, mode)
        ms, rms = c.times.in_mode(mode), c.rival_times.in_mode(mode)
        if not (base and ms and rms):
            return 0.0, 0.0, None, None
        cand.append(base / ms)
        rival.append(base / rms)
        gains.append(rms / ms)
        cis.append(config_gain_in_mode(c, mode)[1])
    return (geometric_mean(cand), geometric_mean(rival), geometric_mean(gains),
            stats.geomean_ci(gains, cis))


def config_gain_in_mode(c: ConfigResult, mode: str
                        ) -> tuple[float | None, tuple[float, float] | None]:
    """Returns one config's duel gain (rival ms / candidate ms) in any mode and its interval
    from each side's own (None, None where either side has no time in that mode)."""
    if c.times is None or c.rival_times is None:
        return None, None
    ms, rms = c.times.in_mode(mode), c.rival_times.in_mode(mode)
    if not (ms and rms):
        return None, None
    return rms / ms, stats.ratio_of_intervals(rms, c.rival_times.ci_in_mode(mode), ms,
                                              c.times.ci_in_mode(mode))


# A duel names a config's loss when the gain's whole interval is below 1 and its point below
# this: over 14 configs in three modes, 95% intervals put about two configs that run the same
# code beyond noise by chance (H200: one duel read identical head-dim-128 code 0.980x
# [0.973, 0.989]), and a config's speedup moves 2-5% between processes.
MATERIAL_LOSS = 0.97


def slower_configs(result: EvalResult, mode: str) -> list[tuple[ConfigResult, float,
                                                                  tuple[float, float]]]:
    """Returns a duel's configs where the candidate is slower than its rival beyond noise and
    by MATERIAL_LOSS or more in a mode, slowest first: what a geometric mean hides, such as a
    kernel-time loss at a config whose call time is the host's. In the duel's own timing
    mode the paired interval counts."""
    out = []
    for c in result.configs:
        gain, ci = ((c.gain, c.gain_ci) if mode == result.timing
                    else config_gain_in_mode(c, mode))
        if gain is not None and ci is not None and ci[1] < 1.0 and gain < MATERIAL_LOSS:
            out.append((c, gain, ci))
    return sorted(out, key=lambda t: t[1])


def fitness(configs: tuple[ConfigResult, ...] | list[ConfigResult]) -> float:
    """Returns the geometric-mean speedup (0 unless every config has one)."""
    return geometric_mean([c.speedup or 0.0 for c in configs])


def fitness_ci(configs: tuple[ConfigResult, ...] | list[ConfigResult]
               ) -> tuple[float, float] | None:
    """Returns the 95% interval of the fitness, from the configs' intervals."""
    return stats.geomean_ci([c.speedup or 0.0 for c in configs], [c.speedup_ci for c in configs])


def rival_fitness(configs: tuple[ConfigResult, ...] | list[ConfigResult], mode: str
                  ) -> tuple[float, tuple[float, float] | None]:
    """Returns a duel's rival fitness (its geometric-mean speedup over the same baselines,
    in the same rounds) and its interval (each config's from speedup and gain)."""
    points, cis = [], []
    for c in configs:
        if not (c.speedup and c.gain):
            return 0.0, None
        points.append(c.speedup / c.gain)         # base/rival = (base/cand) / (rival/cand)
        cis.append(stats.ratio_of_intervals(c.speedup, c.speedup_ci, c.gain, c.gain_ci))
    return geometric_mean(points), stats.geomean_ci(points, cis)


def gain(configs: tuple[ConfigResult, ...] | list[ConfigResult]
         ) -> tuple[float | None, tuple[float, float] | None]:
    """Returns a duel's geometric-mean gain (rival time / candidate time) and its interval."""
    gains = [c.gain for c in configs]
    if not gains or any(g is None for g in gains):
        return None, None
    return geometric_mean(gains), stats.geomean_ci(gains, [c.gain_ci for c in configs])  # type: ignore[arg-type]


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
