"""Exports a run's best kernel with its evidence: source, eval, lineage, leaderboard, README.

Everything is written into a temporary sibling directory that is renamed into
place at the end, so a failed export never leaves half a directory behind.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from evaluator.types import ConfigResult

from .errors import RunDirError
from .report import label
from .store import RunStore
from .types import Program

LEADERBOARD_SIZE = 10
# Every name an export may write; an existing out_dir holding only these is replaced.
_EXPORT_NAMES = {"best.py", "best.cu", "best_eval.json", "lineage.md", "lineage.json",
                 "leaderboard.md", "leaderboard.json", "README.md"}


@dataclasses.dataclass(frozen=True)
class ExportSummary:
    """Where an export put each file, and what it exported."""

    out_dir: Path
    best_source: Path
    best_eval: Path
    lineage_md: Path
    lineage_json: Path
    leaderboard_md: Path
    leaderboard_json: Path
    readme: Path
    best_id: str
    best_fitness: float
    lineage_length: int


def export_run(store_or_run_dir: RunStore | str | Path, out_dir: str | Path) -> ExportSummary:
    """Writes the best correct program and its evidence into out_dir; returns the paths."""
    if isinstance(store_or_run_dir, RunStore):
        return _export(store_or_run_dir, Path(out_dir))
    store = RunStore.open_readonly(store_or_run_dir)
    try:
        return _export(store, Path(out_dir))
    finally:
        store.close()


def _export(store: RunStore, out_dir: Path) -> ExportSummary:
    board = store.leaderboard(LEADERBOARD_SIZE)
    if not board:
        counts = store.counts_by_verdict()
        seen = ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) or "no programs"
        raise RunDirError(f"{store.run_dir}: no correct program to export ({seen})")
    best = board[0]
    lineage = store.lineage(best.id)
    problem = store.meta().get("problem", "")
    files = {
        f"best{best.suffix}": best.source,
        "best_eval.json": _dump(best.result.to_json() if best.result else {}),
        "lineage.md": _lineage_md(lineage),
        "lineage.json": _dump([_lineage_entry(i, p) for i, p in enumerate(lineage)]),
        "leaderboard.md": _leaderboard_md(board),
        "leaderboard.json": _dump([_board_entry(i + 1, p) for i, p in enumerate(board)]),
        "README.md": _readme(best, problem),
    }
    _write_atomically(out_dir, files)
    return ExportSummary(
        out_dir=out_dir, best_source=out_dir / f"best{best.suffix}",
        best_eval=out_dir / "best_eval.json", lineage_md=out_dir / "lineage.md",
        lineage_json=out_dir / "lineage.json", leaderboard_md=out_dir / "leaderboard.md",
        leaderboard_json=out_dir / "leaderboard.json", readme=out_dir / "README.md",
        best_id=best.id, best_fitness=best.fitness, lineage_length=len(lineage))


def _write_atomically(out_dir: Path, files: dict[str, str]) -> None:
    if out_dir.exists():
        if not out_dir.is_dir():
            raise RunDirError(f"{out_dir}: exists and is not a directory")
        foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in _EXPORT_NAMES)
        if foreign:
            raise RunDirError(f"{out_dir}: exists and holds files an export did not write "
                              f"({', '.join(foreign[:3])}); choose another directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        for name, text in files.items():
            (tmp / name).write_text(text)
        if out_dir.exists():
            # A directory cannot be renamed over a non-empty one: move the old export
            # aside first, then drop it once the new one is in place.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            old.rmdir()
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---- file contents ------------------------------------------------------------
def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, allow_nan=False) + "\n"


def _configs(p: Program) -> tuple[ConfigResult, ...]:
    return p.result.configs if p.result else ()


def _lineage_entry(step: int, p: Program) -> dict[str, Any]:
    return {"step": step, "id": p.id, "parent_id": p.parent_id,
            "second_parent_id": p.second_parent_id, "iteration": p.iteration,
            "mutator": p.mutator, "verdict": p.result.verdict.value if p.result else None,
            "fitness": p.fitness, "change": p.change}


def _lineage_md(chain: list[Program]) -> str:
    lines = ["# Lineage", "", f"From the seed to the best program, {len(chain)} steps. "
             "Fitness is the geometric-mean speedup over the problem's baseline.", ""]
    for i, p in enumerate(chain):
        verdict = p.result.verdict.value if p.result else "unevaluated"
        lines += [f"## {i}. `{p.id}` — {p.mutator}, iteration {p.iteration}", "",
                  f"Fitness {p.fitness:.4f}× ({verdict})."
                  + (f" Crossed with `{p.second_parent_id}`." if p.second_parent_id else ""), ""]
        if p.change.strip():
            ticks = "````" if "```" in p.change else "```"   # a fence the text cannot close
            lang = "diff" if _looks_like_diff(p.change) else "text"
            lines += [f"{ticks}{lang}", p.change.rstrip(), ticks, ""]
    return "\n".join(lines)


def _looks_like_diff(text: str) -> bool:
    return any(ln.startswith(("--- ", "+++ ", "@@", "<<<<<<< SEARCH")) for ln in text.splitlines())


def _board_entry(rank: int, p: Program) -> dict[str, Any]:
    return {"rank": rank, "id": p.id, "fitness": p.fitness,
            "verdict": p.result.verdict.value if p.result else None,
            "mutator": p.mutator, "iteration": p.iteration,
            "timing_device": p.result.timing_device if p.result else None,
            "speedups": [{"config": label(c.params), "params": c.params,
                          "dtype": c.dtype, "speedup": c.speedup, "ms": c.ms,
                          "baseline_ms": c.baseline_ms} for c in _configs(p)]}


def _leaderboard_md(board: list[Program]) -> str:
    labels: list[str] = []
    for p in board:
        for c in _configs(p):
            if label(c.params) not in labels:
                labels.append(label(c.params))
    head = ["rank", "id", "fitness", "verdict", "mutator", "iteration"] + labels
    lines = ["# Leaderboard", "", "Top correct programs; speedups are baseline time / "
             "candidate time per config.", ""]
    if any(p.result and p.result.timing_device == "cpu" for p in board):
        lines += ["**Timed on CPU**: these speedups say nothing about GPU performance.", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rank, p in enumerate(board, 1):
        speed = {label(c.params): c.speedup for c in _configs(p)}
        cells = [str(rank), f"`{p.id}`", f"{p.fitness:.4f}",
                 p.result.verdict.value if p.result else "", p.mutator, str(p.iteration)]
        cells += [f"{speed[l]:.3f}×" if speed.get(l) is not None else "—" for l in labels]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _readme(best: Program, problem: str) -> str:
    r = best.result
    where = f"{r.device} ({r.timing_device} timings)" if r else "unknown device"
    lines = [f"# Exported kernel `{best.id}`", "",
             f"The best correct program of this run{f' (problem `{problem}`)' if problem else ''}: "
             f"fitness {best.fitness:.4f}× (geometric-mean speedup over the baseline), "
             f"measured on {where}. `best_eval.json` holds the full evaluation, `lineage.md` "
             "how it was reached, `leaderboard.md` the runners-up.", ""]
    if r and r.timing_device == "cpu":
        lines += ["**These timings were taken on CPU** and say nothing about GPU speed: "
                  "re-check on a GPU before relying on it.", ""]
    if best.suffix == ".py":
        lines += ["## Use it", "",
                  "Put `best.py` next to your code (it imports torch, and triton if it uses it):",
                  "", "```python", "from best import attention", "",
                  "# q, k, v: (B, H, S, D), contiguous, on one device",
                  "out = attention(q, k, v, causal=True, scale=q.shape[-1] ** -0.5)", "```", ""]
    else:
        lines += _cuda_usage(best.source)
    lines += ["## Re-check it", "",
              "Re-evaluate on your own GPU (correctness first, then timing against PyTorch):",
              "", "```sh", f"evoattn eval best{best.suffix}"
              + (f" --problem {problem}" if problem and problem != "sdpa" else ""), "```", ""]
    return "\n".join(lines)


def _cuda_usage(source: str) -> list[str]:
    if "evoattn_sdpa" in source:
        return [
            "## Use it", "",
            "`best.cu` exports the C function `evoattn_sdpa` (see its signature in the file; "
            "it returns 0 or a cudaError_t). Build a shared library for your GPU's "
            "architecture, the way the evaluator built it; on H100/H200 that is the "
            "arch-specific sm_90a target (wgmma and setmaxnreg need it; plain sm_90 "
            "lacks them):", "",
            "```sh", "nvcc -O3 -shared -Xcompiler -fPIC "
            "-gencode=arch=compute_90a,code=sm_90a best.cu -o libbest.so", "```",
            "", "and call it on contiguous (B, H, S, D) tensors:", "",
            "```python", "import ctypes, math, torch", "",
            "lib = ctypes.CDLL('./libbest.so')",
            "out = torch.empty_like(q)",
            "B, H, S, D = q.shape",
            "dtype = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}[q.dtype]",
            "rc = lib.evoattn_sdpa(ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(k.data_ptr()),",
            "                      ctypes.c_void_p(v.data_ptr()), ctypes.c_void_p(out.data_ptr()),",
            "                      B, H, S, D, dtype, int(causal), ctypes.c_float(1 / math.sqrt(D)),",
            "                      ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))",
            "assert rc == 0, f'evoattn_sdpa failed with CUDA error {rc}'", "```", ""]
    return ["## Use it", "",
            "`best.cu` is a PyTorch C++/CUDA extension defining `attention`. Build and load it "
            "with torch:", "",
            "```python", "from torch.utils.cpp_extension import load", "",
            "ext = load(name='best_attention', sources=['best.cu'], "
            "extra_cuda_cflags=['-O3'])",
            "out = ext.attention(q, k, v, causal, scale)", "```", ""]
