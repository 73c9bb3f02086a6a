"""The report's charts as PNG bytes, drawn with matplotlib from report_data's plain series.

Figures are built with `matplotlib.figure.Figure` rather than pyplot: no GUI backend, no
global state, and PNGs come from the Agg renderer. Each function returns None when there is
nothing to draw, and the page says so in words instead.
"""
from __future__ import annotations

import io
import math
from typing import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .report_data import Candidate, Crowning, LineageNode, LlmPoint, NotEvaluated, Speedup

PASS_COLOUR = "#2ca02c"
FAIL_COLOUR = "#d62728"
POINT_COLOUR = "#1f77b4"
ELITE_COLOUR = "#ff7f0e"
# Fixed colours for the common verdicts, so one run's charts compare with another's.
VERDICT_COLOURS = {"pass": PASS_COLOUR, "incorrect": FAIL_COLOUR, "build_error": "#8c564b",
                   "load_error": "#e377c2", "timeout": "#9467bd", "crash": "#7f7f7f",
                   "oom": "#bcbd22", "evaluator_fault": "#17becf", "rejected": "#c7c7c7",
                   "duplicate": "#aec7e8"}
LINEAGE_PER_ROW = 6
DPI = 100


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def fitness_chart(candidates: Sequence[Candidate], seed_fitness: float | None,
                  best: Sequence[Crowning]) -> bytes | None:
    """Returns every evaluated candidate's fitness by iteration, with the best so far (the
    crowned programs' re-measured fitness, report_data.best_line)."""
    if not candidates:
        return None
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    ax = fig.subplots()
    ok = [c for c in candidates if c.verdict == "pass"]
    bad = [c for c in candidates if c.verdict != "pass"]
    ax.scatter([c.iteration for c in ok], [c.fitness for c in ok], s=16, alpha=0.6,
               color=POINT_COLOUR, label="correct candidate (first reading)")
    elites = [c for c in ok if c.elite]
    ax.scatter([c.iteration for c in elites], [c.fitness for c in elites], s=70,
               facecolors="none", edgecolors=ELITE_COLOUR, linewidths=1.5,
               label="in the population now" if elites else None)
    ax.scatter([c.iteration for c in bad], [0.0] * len(bad), marker="x", s=24,
               color=FAIL_COLOUR, label="failed (fitness 0)" if bad else None)
    xs, ys = best_so_far(best, max(c.iteration for c in candidates))
    if xs:
        ax.step(xs, ys, where="post", color=PASS_COLOUR, linewidth=2,
                label="best so far (crowned, re-measured)")
    if seed_fitness:
        ax.axhline(seed_fitness, linestyle="--", color="grey", linewidth=1, label="seed")
    low, high = ax.get_ylim()
    if low <= 1.0 <= high:                  # parity only where it does not squash the points
        ax.axhline(1.0, linestyle=":", color="black", linewidth=0.8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("fitness (geometric-mean speedup)")
    fig.legend(loc="outside upper center", fontsize=8, ncols=5)
    ax.grid(alpha=0.3)
    return _png(fig)


def best_so_far(best: Sequence[Crowning], last_iteration: int) -> tuple[list[int], list[float]]:
    """Returns the best-so-far step line's points: each crowning, held to `last_iteration`."""
    xs = [c.iteration for c in best]
    ys = [c.fitness for c in best]
    if xs:
        xs.append(max(last_iteration, xs[-1]))
        ys.append(ys[-1])
    return xs, ys


def speedup_chart(rows: Sequence[Speedup]) -> bytes | None:
    """Returns one panel per timing mode: the best's speedup per config, a bar per baseline."""
    modes = list(dict.fromkeys(r.mode for r in rows if r.speedup is not None))
    if not modes:
        return None
    configs = list(dict.fromkeys(r.config for r in rows))
    names = list(dict.fromkeys(r.baseline for r in rows))
    fig = Figure(figsize=(10, 0.8 + 2.8 * len(modes)), layout="constrained")
    axes = fig.subplots(len(modes), 1, squeeze=False)[:, 0]
    width = 0.8 / len(names)
    by_key = {(r.mode, r.config, r.baseline): r for r in rows}
    colours = [f"C{i % 10}" for i in range(len(names))]
    for ax, mode in zip(axes, modes):
        for j, name in enumerate(names):
            cells = [by_key.get((mode, cfg, name)) for cfg in configs]
            heights = [c.speedup if c and c.speedup else 0.0 for c in cells]
            edges = ["black" if c and c.fitness_term else "none" for c in cells]
            ax.bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(configs))],
                   heights, width, color=colours[j], edgecolor=edges, linewidth=1.5,
                   label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        values = [r.speedup for r in rows if r.mode == mode and r.speedup]
        if max(values) / min(values) > 8:   # a slow baseline (naive, math) would flatten the rest
            ax.set_yscale("log")
        ax.set_ylabel(f"speedup, {mode} time")
        ax.set_xticks(range(len(configs)), configs, rotation=20, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, title="baseline", loc="outside upper center", fontsize=8,
               ncols=min(6, len(names)))
    return _png(fig)


def lineage_chart(nodes: Sequence[LineageNode]) -> bytes | None:
    """Returns the chain from the seed to the best, left to right, each step with its gain."""
    if not nodes:
        return None
    rows = math.ceil(len(nodes) / LINEAGE_PER_ROW)
    partners = any(n.partner is not None for n in nodes)
    gap = 1.5 if partners else 0.9          # data units between rows; a partner sits above
    fig = Figure(figsize=(12, 0.3 + 1.1 * gap * rows), layout="constrained")
    ax = fig.subplots()
    ax.set_xlim(-0.5, LINEAGE_PER_ROW - 0.5)
    ax.set_ylim(-(rows - 1) * gap - 0.35, 0.35 + (0.5 if partners else 0.0))
    ax.axis("off")
    place = [(float(i % LINEAGE_PER_ROW), -(i // LINEAGE_PER_ROW) * gap)
             for i in range(len(nodes))]
    for i, (node, (x, y)) in enumerate(zip(nodes, place)):
        _box(ax, (x, y), _node_text(i, node), _gain_colour(node.gain))
        if i:
            _link(ax, place[i - 1], (x, y))
        if node.partner is not None:
            p = node.partner
            _box(ax, (x, y + 0.6), f"crossover partner\niteration {p.iteration}, "
                                   f"fitness {p.fitness:.3f}", "white", size=7)
            ax.annotate("", xy=(x, y + 0.2), xytext=(x, y + 0.47), arrowprops=dict(
                arrowstyle="-|>", color="grey", linestyle="--"))
    return _png(fig)


def _link(ax: Axes, a: tuple[float, float], b: tuple[float, float]) -> None:
    """Draws the arrow from one step to the next; a new row is reached through the gutter."""
    arrow = dict(arrowstyle="-|>", color="black")
    if a[1] == b[1]:
        ax.annotate("", xy=(b[0] - 0.42, b[1]), xytext=(a[0] + 0.42, a[1]), arrowprops=arrow)
        return
    gutter = a[1] - 0.45
    ax.plot([a[0], a[0], b[0]], [a[1] - 0.2, gutter, gutter], color="black", linewidth=1)
    ax.annotate("", xy=(b[0], b[1] + 0.2), xytext=(b[0], gutter), arrowprops=arrow)


def _node_text(step: int, node: LineageNode) -> str:
    gain = "start" if node.gain is None else f"{node.gain:+.3f}"
    return f"#{step}  iteration {node.iteration}\n{node.mutator[:20]}\n" \
           f"fitness {node.fitness:.3f} ({gain})"


def _gain_colour(gain: float | None) -> str:
    if gain is None or abs(gain) < 1e-12:
        return "#e8e8e8"
    return "#c7e9c0" if gain > 0 else "#fcbba1"


def _box(ax: Axes, xy: tuple[float, float], text: str, colour: str, size: int = 8) -> None:
    ax.text(xy[0], xy[1], text, ha="center", va="center", fontsize=size,
            bbox=dict(boxstyle="round,pad=0.4", facecolor=colour, edgecolor="#555555"))


def verdict_chart(candidates: Sequence[Candidate],
                  not_evaluated: Sequence[NotEvaluated]) -> bytes | None:
    """Returns stacked counts of each verdict (and of unevaluated proposals) per iteration bucket."""
    events = [(c.iteration, c.verdict) for c in candidates] + \
             [(n.iteration, n.kind) for n in not_evaluated]
    if not events:
        return None
    last = max(it for it, _ in events)
    bucket = max(1, math.ceil((last + 1) / 25))
    kinds = sorted({k for _, k in events}, key=lambda k: (k != "pass", k in
                                                          ("rejected", "duplicate"), k))
    starts = list(range(0, last + 1, bucket))
    counts = {k: [0] * len(starts) for k in kinds}
    for it, kind in events:
        counts[kind][it // bucket] += 1
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    ax = fig.subplots()
    bottom = [0] * len(starts)
    for i, kind in enumerate(kinds):
        ax.bar(starts, counts[kind], bucket * 0.9, bottom=bottom, align="edge", label=kind,
               color=VERDICT_COLOURS.get(kind, f"C{i % 10}"))
        bottom = [b + n for b, n in zip(bottom, counts[kind])]
    ax.set_xlabel(f"iteration ({bucket} per bar)" if bucket > 1 else "iteration")
    ax.set_ylabel("proposals")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.legend(loc="outside upper center", fontsize=8, ncols=min(6, len(kinds)))
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def throughput_chart(candidates: Sequence[Candidate],
                     stage_mean_s: dict[str, float]) -> bytes | None:
    """Returns candidates evaluated per minute over wall time, and mean seconds per stage."""
    if not candidates:
        return None
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[3, 2])
    minutes = sorted(c.minute for c in candidates)
    span = max(minutes[-1], 1 / 60)
    # About four candidates a bar (at most 30 bars, at least a second each): a rate from
    # one or two candidates is mostly noise.
    width = max(span / min(30, max(1, len(minutes) // 4)), 1 / 60)
    bars = [0] * max(1, math.ceil(span / width - 1e-9))
    for m in minutes:
        bars[min(int(m // width), len(bars) - 1)] += 1
    left.bar([i * width for i in range(len(bars))], [n / width for n in bars], width * 0.9,
             align="edge", color=POINT_COLOUR)
    left.axhline(len(minutes) / span, linestyle="--", color="black", linewidth=1,
                 label=f"whole run: {len(minutes) / span:.1f}/min")
    left.set_xlabel("minutes since the run was created")
    left.set_ylabel("candidates evaluated per minute")
    left.legend(fontsize=8)
    left.grid(axis="y", alpha=0.3)
    stages = list(stage_mean_s)
    right.barh(stages, [stage_mean_s[s] for s in stages], color="#9467bd")
    right.invert_yaxis()                    # stages top to bottom in the order they run
    right.set_xlabel("mean seconds per candidate")
    for y, s in enumerate(stages):
        right.text(stage_mean_s[s], y, f" {stage_mean_s[s]:.2f}", va="center", fontsize=8)
    right.margins(x=0.25)
    return _png(fig)


def llm_chart(points: Sequence[LlmPoint]) -> bytes | None:
    """Returns the running totals of LLM tokens and cost (USD) over wall time."""
    if not points:
        return None
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    ax = fig.subplots()
    xs = [p.minute for p in points]
    ax.step(xs, [p.prompt_tokens for p in points], where="post", label="prompt tokens")
    ax.step(xs, [p.completion_tokens for p in points], where="post", label="completion tokens")
    ax.set_xlabel("minutes since the run was created")
    ax.set_ylabel("tokens (running total)")
    cost = ax.twinx()
    cost.step(xs, [p.cost_usd for p in points], where="post", color="black", linestyle="--",
              label="cost")
    cost.set_ylabel("cost, USD (running total)")
    lines = ax.get_legend_handles_labels()
    more = cost.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    return _png(fig)
