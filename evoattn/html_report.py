"""`evoattn report`: one HTML page with PNG charts beside it, about one run.

The page is self-contained apart from its PNGs: inline CSS, no script, nothing fetched from
the network. It reads the run read-only, so it works on a run in progress, and is written
into a temporary sibling directory renamed into place (RUN_DIR/report by default): a
failed report never leaves half a directory behind, nor replaces a good one.
"""
from __future__ import annotations

import datetime
import html
from pathlib import Path
from typing import Callable

from . import charts
from .outdir import replace_directory
from .report import MODE_WORDS, set_back_lines, side_by_side_lines
from .report_data import RunData, Speedup, load_run

HTML_NAME = "report.html"
# Each chart: its file, its heading, what it shows, and what the page says without it.
_CHARTS: tuple[tuple[str, str, str, str], ...] = (
    ("fitness.png", "Fitness over iterations",
     "Every evaluated candidate's fitness as first read (failures at 0, marked ×); the best "
     "so far: the seed, then each child crowned by a duel beside the best of its time, at "
     "its re-measured fitness, ending at the best's figure above (a high first reading that "
     "was never confirmed is not the best); the seed's fitness (dashed) and, where in range, "
     "parity with the baseline (dotted, 1.0).",
     "No candidate has been evaluated yet."),
    ("speedup.png", "Speedup of the best, per config",
     "Baseline time / the best's time, one panel per timing mode, a bar per baseline; the "
     "bars with a black edge are the ones fitness uses.",
     "No correct program yet, or no timed config: nothing to compare."),
    ("lineage.png", "Lineage of the best",
     "The first-parent chain from the seed to the best: each step's iteration, mutator, "
     "fitness and gain over its parent (green: better, red: worse); a crossover's second "
     "parent hangs below its child.",
     "No correct program yet: there is no lineage to draw."),
    ("verdicts.png", "Verdicts over time",
     "What became of each iteration's proposal: its verdict, or not evaluated (rejected by "
     "its mutator, or a duplicate of a stored program).",
     "No proposal has been recorded yet."),
    ("throughput.png", "Evaluation throughput",
     "Candidates evaluated per minute of wall time (left) and where an evaluation's time "
     "goes: the mean seconds of each stage (right).",
     "No candidate has been evaluated yet."),
    ("llm.png", "LLM tokens and cost",
     "Running totals of prompt and completion tokens, and of the cost in USD.",
     "This run made no LLM calls (the offline knob mutator needs none)."),
)
_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
       max-width: 1100px; margin: 24px auto; padding: 0 16px; line-height: 1.45; }
h1 { font-size: 1.6em; margin-bottom: 4px; } h2 { margin-top: 36px; font-size: 1.25em; }
table { border-collapse: collapse; margin: 8px 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.summary th { background: #f4f4f4; width: 190px; }
.fitness-term { font-weight: bold; background: #eef6ea; }
.warning { border: 2px solid #d9822b; background: #fff4e5; padding: 8px 12px; }
img { max-width: 100%; border: 1px solid #ddd; }
.caption { color: #555; font-size: 0.9em; margin-top: 2px; }
small { color: #666; }
"""


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Writes report.html and its charts into out_dir (default RUN_DIR/report); returns the page."""
    data = load_run(run_dir)
    target = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    pngs = {name: png for name, png in _draw(data).items() if png is not None}
    page = render(data, set(pngs))
    replace_directory(target, {HTML_NAME: page.encode(), **pngs}, _ours, "a report",
                      "choose another --out")
    return target / HTML_NAME


def _draw(data: RunData) -> dict[str, bytes | None]:
    draw: dict[str, Callable[[], bytes | None]] = {
        "fitness.png": lambda: charts.fitness_chart(data.candidates, data.seed_fitness,
                                                     data.best_line),
        "speedup.png": lambda: charts.speedup_chart(data.speedups),
        "lineage.png": lambda: charts.lineage_chart(data.lineage),
        "verdicts.png": lambda: charts.verdict_chart(data.candidates, data.not_evaluated),
        "throughput.png": lambda: charts.throughput_chart(data.candidates, data.stage_mean_s),
        "llm.png": lambda: charts.llm_chart(data.llm),
    }
    return {name: make() for name, make in draw.items()}


def render(data: RunData, drawn: set[str]) -> str:
    """Returns the page's HTML; `drawn` names the chart files that exist beside it."""
    parts = [f"<h1>evoattn run: {_e(data.name)}</h1>", _summary(data)]
    if data.timing_device == "cpu":
        parts.append('<p class="warning"><b>CPU timings.</b> This run was timed on the CPU '
                     "(Triton's interpreter): its speedups say nothing about GPU "
                     "performance.</p>")
    for name, title, caption, absent in _CHARTS:
        parts.append(f"<h2>{_e(title)}</h2>")
        if name in drawn:
            parts.append(f'<img src="{name}" alt="{_e(title)}">'
                         f'<p class="caption">{_e(caption)}</p>')
        else:
            parts.append(f"<p>{_e(absent)}</p>")
        if name == "speedup.png" and data.speedups:
            parts.append(_speedup_table(data.speedups))
        if name == "lineage.png" and data.lineage:
            parts.append(_lineage_table(data))
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>evoattn report: {_e(data.name)}</title><style>{_CSS}</style></head>"
            f"<body>\n{body}\n</body></html>\n")


def _summary(data: RunData) -> str:
    counts: dict[str, int] = {}
    for c in data.candidates:
        counts[c.verdict] = counts.get(c.verdict, 0) + 1
    for n in data.not_evaluated:
        counts[n.kind] = counts.get(n.kind, 0) + 1
    best, shown = data.best, data.best_fitness
    duel = data.beside_seed[1] if data.beside_seed else None
    if shown is not None and duel is not None and duel.correct and duel.rival_fitness:
        fitness = (f"{duel.rival_fitness:.4f} → {shown:.4f} "
                   f"({shown / duel.rival_fitness - 1:+.1%}), re-measured side by side "
                   "at the end of the run (below)")
    elif shown is not None and data.seed_fitness:
        change = f" ({shown / data.seed_fitness - 1:+.1%})"
        fitness = f"{data.seed_fitness:.4f} → {shown:.4f}{change}"
    elif shown is not None:
        fitness = f"seed failed → {shown:.4f}"
    else:
        fitness = "no correct program yet"
    vs = "the fastest baseline per config" if data.baseline == "best" else data.baseline
    rows = [
        ("problem", data.problem), ("seed", data.seed_path),
        ("device", f"{data.device} (timed on {data.timing_device})"),
        ("timing mode", MODE_WORDS.get(data.timing, data.timing) + " (what fitness uses)"),
        ("baseline policy", vs),
        ("seed → best fitness", fitness),
        ("best program", f"{best.id}, iteration {best.iteration}, {best.mutator}"
         if best else "-"),
        ("iterations", f"{data.iterations_done} of {data.iterations_planned}"),
        ("status", f"stopped: {data.stop_reason}" if data.stop_reason else
         "no stop recorded: running now (or killed)"),
        ("wall time", f"{data.elapsed_s:.0f} s" if data.elapsed_s < 120 else
         f"{data.elapsed_s / 60:.1f} min"),
        ("proposals", ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"),
        ("report written", datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")),
    ]
    cells = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    table = f'<table class="summary">{cells}</table>'
    if data.set_back is not None:
        lines = [f"set back at the end of the run, beside the best it had "
                 f"({data.set_back['before']}):", *set_back_lines(data.set_back)]
        table += f"<pre class=\"set-back\">{_e(chr(10).join(lines))}</pre>"
    if data.beside_seed is None or best is None:
        return table
    lines = side_by_side_lines(data.beside_seed[1], data.beside_seed[0], best.id)
    return table + f"<pre class=\"beside-seed\">{_e(chr(10).join(lines))}</pre>"


def _speedup_table(rows: tuple[Speedup, ...]) -> str:
    modes = [m for m in dict.fromkeys(r.mode for r in rows)
             if any(r.speedup is not None for r in rows if r.mode == m)]
    head = "".join(f"<th>{_e(MODE_WORDS.get(m, m))}</th>" for m in modes)
    by_key = {(r.config, r.baseline, r.mode): r for r in rows}
    lines = []
    for config, name in dict.fromkeys((r.config, r.baseline) for r in rows):
        cells = "".join(_speedup_cell(by_key.get((config, name, m))) for m in modes)
        lines.append(f"<tr><td>{_e(config)}</td><td>{_e(name)}</td>{cells}</tr>")
    missing = [m for m in dict.fromkeys(r.mode for r in rows) if m not in modes]
    note = (f'<p class="caption">Not measured: {_e(", ".join(missing))} time.</p>'
            if missing else "")
    return (f"<table><tr><th>config</th><th>baseline</th>{head}</tr>{''.join(lines)}</table>"
            '<p class="caption">Speedup = baseline ms / best ms (both shown, baseline first); '
            f"the bold cells are what fitness uses.</p>{note}")


def _speedup_cell(row: Speedup | None) -> str:
    if row is None or row.speedup is None:
        return '<td class="num">-</td>'
    css = "num fitness-term" if row.fitness_term else "num"
    return (f'<td class="{css}">{row.speedup:.3f}×<br><small>{row.baseline_ms:.4f} / '
            f"{row.candidate_ms:.4f} ms</small></td>")


def _lineage_table(data: RunData) -> str:
    lines = []
    for i, n in enumerate(data.lineage):
        gain = "-" if n.gain is None else f"{n.gain:+.4f}"
        change = n.change.strip().splitlines()[0][:160] if n.change.strip() else ""
        partner = f" (crossover with {n.partner.program_id})" if n.partner else ""
        lines.append(f'<tr><td class="num">{i}</td><td class="num">{n.iteration}</td>'
                     f"<td>{_e(n.mutator)}</td><td class=\"num\">{n.fitness:.4f}</td>"
                     f'<td class="num">{gain}</td><td>{_e(change + partner)}</td>'
                     f"<td>{_e(n.judged)}</td></tr>")
    return ("<table><tr><th>step</th><th>iteration</th><th>mutator</th><th>fitness</th>"
            "<th>gain</th><th>change</th><th>beside the best of its time</th></tr>"
            f"{''.join(lines)}</table>")


def _e(text: object) -> str:
    return html.escape(str(text))


def _ours(_out_dir: Path) -> set[str]:
    return {HTML_NAME} | {name for name, *_ in _CHARTS}
