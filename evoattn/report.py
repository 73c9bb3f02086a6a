"""Rich renderings of results: the eval tables, the closing block, baselines, problems."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Protocol

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from evoattn.contract import scoring

from evoattn.contract import stats
from evoattn.contract.runtime import perf_notes
from evoattn.problems.base import plain_label
from evoattn.contract.names import MODE_WORDS, TIMING_MODES
from evoattn.contract.types import ConfigResult, EvalResult, Times, Verdict

from .prune import PRUNE, costs_nothing
from .types import Program


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None or isinstance(x, str) else format(x, fmt)


def label(params: dict[str, Any]) -> str:
    """Returns a short label for a config's params."""
    if {"B", "H", "S", "D"} <= params.keys():
        c = " causal" if params.get("causal") else ""
        rest = "".join(f" {k}={v}" for k, v in params.items()
                       if k not in ("B", "H", "S", "D", "causal"))
        return f"({params['B']},{params['H']},{params['S']},{params['D']}){c}{rest}"
    return plain_label(params)


def pm(point: float | None, ci: Any, fmt: str = ".3f") -> str:
    """Returns '0.942x ± 0.006' (the half-width of the 95% interval), or '0.942x' without one."""
    if not point:
        return "-"
    half = stats.plus_minus(point, tuple(ci) if ci else None)
    return f"{point:{fmt}}x" + (f" ± {half:{fmt}}" if half is not None else "")


def headline(result: EvalResult) -> str:
    """Returns e.g. '0.94x ± 0.01 vs the best baseline, call time' (the fitness, named)."""
    vs = "the best baseline" if result.baseline == "best" else result.baseline
    cpu = " (CPU timing)" if result.timing_device == "cpu" else ""
    return (f"{pm(result.fitness, result.fitness_ci, '.3f')} vs {vs}, "
            f"{MODE_WORDS.get(result.timing, result.timing)}{cpu}")


def duel_lines(result: EvalResult) -> list[str]:
    """Returns the lines on a duel (a rival timed beside the candidate), if it was one."""
    if not result.rival or not result.correct or result.gain is None:
        return []
    ci = result.gain_ci
    verdict = ("no gain beyond noise" if ci is None or ci[0] <= 1.0 <= ci[1] else
               "the candidate is faster" if ci[0] > 1.0 else "the candidate is slower")
    lines = [f"Rival: {result.rival}, timed in the same rounds: "
             f"{pm(result.rival_fitness, result.rival_fitness_ci)} vs the same baselines",
             f"Gain: the candidate is {result.gain:.3f}x the rival's speed (95% interval "
             + (f"{ci[0]:.3f} to {ci[1]:.3f}" if ci else "not known") + f"): {verdict}"]
    for mode in TIMING_MODES:
        slower = slower_line(result, mode)
        if slower:
            lines.append(f"  in {mode} time the candidate is slower beyond noise, by "
                         f"{_LOSS} or more, at {slower}")
    return lines


_LOSS = f"{1 - scoring.MATERIAL_LOSS:.0%}"        # "3%"


def slower_line(result: EvalResult, mode: str, most: int = 4) -> str:
    """Returns the configs where a duel's candidate is slower than its rival beyond noise (and
    by MATERIAL_LOSS) in one mode, slowest first, as one phrase ("" when there are none)."""
    slower = scoring.slower_configs(result, mode)
    parts = [f"{label(c.params)} {gain:.3f}x{ci_text(ci)}"
             for c, gain, ci in slower[:most]]
    more = len(slower) - most
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def eval_table(result: EvalResult) -> Table:
    """Returns the per-config table of one evaluation, in its timing mode."""
    cpu = result.timing_device == "cpu"
    mode = MODE_WORDS.get(result.timing, result.timing)
    t = Table(title=f"{result.candidate} on {result.device}: {mode}, against "
                    f"{'the fastest baseline' if result.baseline == 'best' else result.baseline}"
                    + (" — CPU timings (Triton interpreter), not GPU performance" if cpu else ""))
    for col in ("config", "verdict", "max err", "tol", "ms", "baseline", "baseline ms",
                "speedup", "TFLOP/s", "host µs", "baseline host µs", "mem MB"):
        t.add_column(col, justify="left" if col in ("config", "verdict", "baseline") else "right")
    for c in result.configs:
        style = "green" if c.verdict is Verdict.PASS else "red"
        base = c.baseline_times.get(c.baseline_name)
        t.add_row(label(c.params), f"[{style}]{c.verdict.value}[/{style}]",
                  _f(c.max_abs_err, ".2e"), _f(c.tolerance, ".2e"), _f(c.ms, ".4f"),
                  c.baseline_name or "-", _f(c.baseline_ms, ".4f"),
                  pm(c.speedup, c.speedup_ci), _f(c.tflops, ".1f"),
                  _f(c.times.host_us if c.times else None, ".1f"),
                  _f(base.host_us if base else None, ".1f"),
                  _f(c.peak_mem_bytes / 2**20 if c.peak_mem_bytes is not None else None, ".1f"))
    return t


def modes_table(result: EvalResult) -> Table | None:
    """Returns every timing mode of the candidate and each baseline, per config (ms)."""
    rows = [c for c in result.configs if c.times is not None]
    if not rows:
        return None
    names = list(dict.fromkeys(n for c in rows for n in c.baseline_times))
    t = Table(title="every mode (ms): kernel / call / graph; host µs per call: with the GPU "
                    "busy / issuing call mode's calls (near the call time: host-bound)")
    t.add_column("config")
    for who in ["candidate"] + names:
        t.add_column(who, justify="right")
    for c in rows:
        cells = [_modes(c.times)] + [_modes(c.baseline_times.get(n)) for n in names]
        t.add_row(label(c.params), *cells)
    return t


def _modes(times: Any) -> str:
    if times is None:
        return "-"
    return (f"{_f(times.kernel_ms, '.4f')} / {_f(times.call_ms, '.4f')} / "
            f"{_f(times.graph_ms, '.4f')}; {_f(times.host_us, '.0f')} / "
            f"{_f(times.issue_us, '.0f')}")


def backends_table(result: EvalResult) -> Table | None:
    """Returns the diagnostic backends' times per config (--all-backends), if timed."""
    names = sorted({n for c in result.configs for n in c.backends_ms})
    if not names:
        return None
    t = Table(title=f"every backend ({MODE_WORDS.get(result.timing, result.timing)} ms; "
                    "speedup of the candidate over it)")
    t.add_column("config")
    t.add_column("candidate", justify="right")
    for n in names:
        t.add_column(n, justify="right")
    for c in result.configs:
        cells = []
        for n in names:
            ms = c.backends_ms.get(n)
            cells.append("-" if ms is None or not c.ms else f"{ms:.4f} ({ms / c.ms:.2f}x)")
        t.add_row(label(c.params), _f(c.ms, ".4f"), *cells)
    return t


def other_modes(result: EvalResult, flops: Callable[[dict[str, Any]], float]) -> str:
    """Returns the fitness the same times give in the other modes, e.g. 'kernel time 0.95x'."""
    parts = []
    for mode in TIMING_MODES:
        if mode == result.timing:
            continue
        _, value = scoring.rescore(result.configs, mode, result.baseline, flops)
        parts.append(f"{MODE_WORDS[mode]} {value:.2f}x" if value else f"{MODE_WORDS[mode]} -")
    return ", ".join(parts)


def cost_summary(results: list[EvalResult], elapsed_s: float | None = None,
                 evaluated: int | None = None) -> str:
    """Returns one line on what the evaluations cost: count, rate, mean seconds, main stages."""
    timed = [r for r in results if r.stage_s]
    if not timed:
        return ""
    mean = sum(r.duration_s for r in timed) / len(timed)
    stages: dict[str, float] = {}
    for r in timed:
        for name, sec in r.stage_s.items():
            stages[name] = stages.get(name, 0.0) + sec / len(timed)
    top = sorted(stages.items(), key=lambda kv: -kv[1])[:4]
    rate = (f"; {evaluated / (elapsed_s / 60):.1f} per minute this session"
            if elapsed_s and evaluated else "")
    return (f"evaluations: {len(timed)}, {mean:.1f} s each on average ("
            + ", ".join(f"{name} {sec:.1f}" for name, sec in top) + f"){rate}")


# The sandbox's names for a single-file program and its rival (sandbox.py), with the
# temporary directory a path to them may carry.
_SANDBOX_NAME = re.compile(r"(?<![\w.-])(?:[\w.-]*/)*(candidate|rival)\.(?:cu|py)\b")


def in_user_terms(result: EvalResult, path: str, rival: str | None = None) -> EvalResult:
    """Returns the result with the sandbox's file names (candidate.cu, .../rival.py) replaced
    by the user's paths in every message it carries: reasons, flags, build log, log tail."""
    def user(text: str) -> str:
        return _SANDBOX_NAME.sub(lambda m: path if m[1] == "candidate" else rival or m[0], text)
    configs = tuple(dataclasses.replace(c, reason=user(c.reason)) for c in result.configs)
    return dataclasses.replace(result, reason=user(result.reason),
                               build_log=user(result.build_log), log_tail=user(result.log_tail),
                               flags=tuple(user(f) for f in result.flags), configs=configs)


def print_eval(console: Console, result: EvalResult,
               flops: Callable[[dict[str, Any]], float] | None = None) -> None:
    """Prints the tables and the closing block (Correctness / Speedup / Score); a file only
    compiled (no GPU to run it) gets no score: nothing was scored."""
    if result.configs:
        console.print(eval_table(result))
        for extra in (modes_table(result), backends_table(result)):
            if extra is not None:
                console.print(extra)
    if result.build_cached is not None:
        console.print(f"build: {'cached (skipped)' if result.build_cached else 'built'}"
                      + (f" in {result.build_seconds:.1f} s" if result.build_seconds else ""))
    if result.stage_s:
        console.print(f"time: {result.duration_s:.1f} s (" + ", ".join(
            f"{k} {v:.1f}" for k, v in result.stage_s.items()) + ")")
    for flag in result.flags:
        console.print(f"[yellow]flag[/yellow]: {flag}")
    for note in perf_notes(result.build_log):
        console.print(f"[yellow]ptxas[/yellow]: {escape(note)}")
    for line in remeasured_lines(result) + host_bound_lines(result):
        console.print(line)
    ok = result.correct
    if result.verdict is Verdict.COMPILED:
        console.print(f"Compiled: {result.reason}")
    else:
        console.print(f"Correctness: {'[green]PASS[/green]' if ok else '[red]FAIL[/red]'}"
                      + ("" if ok else f" ({result.verdict.value}: {result.reason})")
                      + (f" in {', '.join(result.dtypes)}, timed in {result.dtypes[0]}"
                         if ok and len(result.dtypes) > 1 else ""))
    timed = [c.speedup for c in result.configs if c.speedup]
    if ok and timed:
        console.print(f"Speedup: {headline(result)} (geometric mean over {len(timed)} configs)")
        if flops is not None:
            console.print(f"  the same times in the other modes: {other_modes(result, flops)}")
    for line in duel_lines(result):
        console.print(line)
    if result.verdict is not Verdict.COMPILED:
        console.print(f"Score: {result.fitness:.4f}")


def host_bound(result: EvalResult, c: ConfigResult) -> bool:
    """Whether the host set a config's call times (its candidate's or its baseline's calls
    issued at about their rate, Times.host_bound); GPU call-time results only."""
    if result.timing != "call" or result.timing_device == "cpu" or c.times is None:
        return False
    return c.times.host_bound() or (c.baseline_times.get(c.baseline_name) or Times()).host_bound()


def host_bound_labels(result: EvalResult) -> list[str]:
    """The labels of the configs whose call times the host set (host_bound)."""
    return [label(c.params) for c in result.configs if host_bound(result, c)]


def host_bound_lines(result: EvalResult) -> list[str]:
    """Names the configs whose call times the host set (the candidate's or its baseline's
    calls issued at about their rate, Times.host_bound): their ratios compare host paths, move
    with the host's speed, and say little about the kernels. GPU call-time results only."""
    bound = host_bound_labels(result)
    if not bound:
        return []
    return [f"host-bound in call time (calls issued at about their rate; the host's speed sets "
            f"these ratios): {', '.join(bound)}"]


def remeasured_lines(result: EvalResult) -> list[str]:
    """Returns what the evaluator measured again and why (evoattn/child/measure.py, timing.py,
    sandbox.py): configs whose baselines' own times showed a disturbance or whose timing CPU
    slowed while they were host-bound, call rounds that lost their CPU, a candidate evaluated
    again after an evaluator fault."""
    info = result.device_info or {}
    lines = [f"measured again: {config} ({why})"
             for config, why in (info.get("configs_remeasured") or {}).items()]
    if info.get("evaluated_again"):
        lines.append(f"measured again: the whole candidate, after an evaluator fault "
                     f"({info['evaluated_again']})")
    rounds = info.get("call_rounds_redone")
    if rounds:
        lines.append(f"measured again: {rounds} call-mode round{'s' if rounds > 1 else ''} "
                     "whose launches lost their CPU (another process on it)")
    return lines


def baseline_table(rows: list[dict[str, Any]], device: str) -> Table:
    """Returns the table of every baseline and backend per config: ms in each mode, host µs."""
    names = list(dict.fromkeys(n for r in rows for n in r["times"]))
    t = Table(title=f"PyTorch on {device}: ms in kernel / call / graph time; host µs")
    t.add_column("config")
    for n in names:
        t.add_column(n, justify="right")
    for r in rows:
        cells = []
        for n in names:
            times = r["times"].get(n)
            cells.append("n/a" if not times else
                         f"{_f(times.get('kernel_ms'), '.4f')} / {_f(times.get('call_ms'), '.4f')}"
                         f" / {_f(times.get('graph_ms'), '.4f')}; "
                         f"{_f(times.get('host_us'), '.0f')}")
        t.add_row(label(r["cfg"]), *cells)
    return t


def problem_text(p: Any) -> str:
    """Returns what `evoattn problems` prints for one problem."""
    lines = [f"[bold]{p.name}[/bold] — {p.summary}", f"  contract: {p.contract}"]
    if p.cuda_symbol:
        lines.append("  CUDA fast form:\n    " + p.cuda_signature.replace("\n", "\n    "))
    lines += [f"  domain: {p.domain}",
              f"  dtypes: {', '.join(p.dtypes)} (default {p.default_dtype})",
              "  configs (GPU): " + "; ".join(p.label(c) for c in p.default_configs),
              "  configs (CPU, Triton's interpreter): "
              + "; ".join(p.label(c) for c in p.cpu_configs),
              f"  baselines: {', '.join(p.baseline_names)} ({p.baseline_name}); fitness takes "
              "the fastest unless evaluator.baseline names one", ""]
    return "\n".join(lines)


def side_by_side_lines(duel: Any, seed_id: str, best_id: str) -> list[str]:
    """Returns the summary's lines for the best re-measured beside the seed (a duel whose
    candidate is the best and whose rival is the seed): every mode, and whether the gain is
    beyond noise."""
    if not duel.correct:
        return [f"re-measuring the seed and the best side by side failed: "
                f"{duel.verdict.value}: {duel.reason[:200]}"]
    lines = [f"seed ({seed_id}) and best ({best_id}) re-measured side by side in one process "
             f"(fitness against {duel.baseline}, 95% intervals):"]
    for mode in [duel.timing] + [m for m in TIMING_MODES if m != duel.timing]:
        if mode == duel.timing:
            cand, rival, gain, ci = (duel.fitness, duel.rival_fitness or 0.0, duel.gain,
                                     duel.gain_ci)
        else:
            cand, rival, gain, ci = scoring.duel_in_mode(duel.configs, mode, duel.baseline)
        if not gain:
            lines.append(f"  {mode} time: not measured for both")
            continue
        verdict = ("no gain beyond noise" if ci is None or ci[0] <= 1.0 <= ci[1] else
                   "the best is faster" if ci[0] > 1.0 else "the best is slower")
        lines.append(f"  {mode} time: seed {rival:.4f} -> best {cand:.4f}; best vs seed "
                     f"{gain:.3f}x{ci_text(ci)}: {verdict}")
        slower = slower_line(duel, mode)
        if slower:
            lines.append(f"    the best is slower than the seed beyond noise, by {_LOSS} or more, "
                         f"at {slower}")
    return lines


def set_back_lines(record: dict[str, Any]) -> list[str]:
    """Returns a line per change the end of a run set back (store.record_pruned's steps)."""
    return [set_back_line(step) for step in record.get("steps") or []]


def set_back_line(step: dict[str, Any]) -> str:
    """Returns one setting-back step: the change, its duel beside the best the phase started
    from, and whether the change stayed set back."""
    met = f" ({step['program']}, met in the search)" if step.get("met") else ""
    asleep = step.get("runs_no_call")     # several knobs whose code runs no call, together
    if step["verdict"] != "pass":
        what = f"{step['verdict']}: {step.get('reason', '')}; " + \
            ("each tried alone" if asleep else "kept")
    else:
        what = (f"{step['gain'] or 0.0:.3f}x{ci_text(step['gain_ci'])}: "
                + ("costs nothing, set back" if step["kept_back"] else
                   "costs beyond noise, each tried alone" if asleep else "it pays, kept"))
    return f"{step['change']}{' (code that runs no call)' if asleep else ''}{met}: {what}"


def ci_text(ci: Any) -> str:
    """Returns ' [lo, hi]' for an interval, '' for none."""
    return f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""


@dataclasses.dataclass(frozen=True)
class Duel:
    """A program's duel beside the best of its time: its gain (the rival's time over its own,
    geometric mean), the gain's interval, and whether it was faster beyond noise (and so
    became the best)."""

    rival: str
    gain: float
    gain_ci: tuple[float, float] | None
    won: bool

    def to_json(self) -> dict[str, Any]:
        return {"rival": self.rival, "gain": self.gain,
                "gain_ci": list(self.gain_ci) if self.gain_ci else None, "won": self.won}


class Judged(Protocol):
    """What crowned_changes reads of a program (a Program, or a store's lighter row)."""

    @property
    def change(self) -> str: ...
    @property
    def iteration(self) -> int: ...
    @property
    def result(self) -> EvalResult | None: ...


def duel_of(p: Judged) -> Duel | None:
    """A program's duel beside the best of its time, if it had one."""
    r = p.result
    if r is None or not r.rival or r.gain is None:
        return None
    return Duel(r.rival, r.gain, r.gain_ci, beats(r))


def crowned_changes(programs: Iterable[Judged]) -> dict[str, int]:
    """Returns {change: the first iteration whose program, so changed, won a duel}: a step
    never re-measured itself may carry a change that was proven on another parent."""
    out: dict[str, int] = {}
    for p in sorted(programs, key=lambda q: q.iteration):
        duel = duel_of(p)
        if duel and duel.won and p.change.strip():
            out.setdefault(p.change, p.iteration)
    return out


def beats(duel: EvalResult) -> bool:
    """Returns whether a duel's candidate is faster than its rival beyond the noise: the 95%
    interval of the gain (rival time / candidate time, geometric mean) lies above 1."""
    return duel.correct and duel.gain_ci is not None and duel.gain_ci[0] > 1.0


def duel_phrase(p: Program, crowned: dict[str, int]) -> str:
    """Returns a few words on how a lineage step was judged beside the best of its time (its
    duel, or the same change's elsewhere in the run: `crowned`, from crowned_changes)."""
    duel = duel_of(p)
    if duel is not None and p.mutator == PRUNE:
        kept = costs_nothing(p.result) if p.result else False
        return (f"set back at the end of the run, {'costing nothing' if kept else 'a loss'}: "
                f"{duel.gain:.3f}x{ci_text(duel.gain_ci)}")
    if duel is not None:
        return (f"{'crowned' if duel.won else 'not faster beyond noise'}: "
                f"{duel.gain:.3f}x{ci_text(duel.gain_ci)}")
    if p.change in crowned:
        return f"not re-measured; the same change crowned at iteration {crowned[p.change]}"
    return "never re-measured: unproven"
