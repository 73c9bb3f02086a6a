"""The text files of an export: lineage, leaderboard and the package's README."""
from __future__ import annotations

import json
from typing import Any

from evoattn.problems import OpDocs, Problem, builtin_names, get_problem
from evoattn.contract.request import DEFAULTS
from evoattn.contract.names import MODE_DESCRIPTIONS as MODE_WORDS
from evoattn.contract.types import ConfigResult, EvalResult

from .export_package import KernelInfo
from .report import (duel_of, duel_phrase, host_bound_labels, label, set_back_lines,
                     side_by_side_lines)
from .types import Program

MODES = tuple(MODE_WORDS)             # kernel, call, graph: the descriptions' order


def dump(obj: Any) -> str:
    """Returns obj as indented JSON text (NaN refused)."""
    return json.dumps(obj, indent=2, allow_nan=False) + "\n"


def _configs(p: Program) -> tuple[ConfigResult, ...]:
    return p.result.configs if p.result else ()


# ---- lineage and leaderboard ------------------------------------------------------
def lineage_entry(step: int, p: Program) -> dict[str, Any]:
    """Returns one step of the lineage as JSON data (`duel`: how it fared re-measured beside
    the best of its time, or None where it never was)."""
    return {"step": step, "id": p.id, "parent_id": p.parent_id,
            "second_parent_id": p.second_parent_id, "iteration": p.iteration,
            "mutator": p.mutator, "verdict": p.result.verdict.value if p.result else None,
            "fitness": p.fitness, "change": p.change,
            "duel": duel.to_json() if (duel := duel_of(p)) else None}


def lineage_md(chain: list[Program], crowned: dict[str, int] | None = None) -> str:
    """Returns the lineage from the seed to the best program, one section a step (`crowned`:
    the run's changes that won a duel somewhere, from crowned_changes)."""
    lines = ["# Lineage", "", f"From the seed to the best program, {len(chain)} steps. "
             "Fitness is the geometric-mean speedup over the problem's baseline. A step never "
             "re-measured beside the run's best did not read above it beyond its own noise; "
             "unless the same change won a duel elsewhere in the run, it came along unproven "
             "and may cost time where the fitness does not look (the README's re-measurement "
             "beside the seed names such configs).", ""]
    for i, p in enumerate(chain):
        verdict = p.result.verdict.value if p.result else "unevaluated"
        lines += [f"## {i}. `{p.id}` — {p.mutator}, iteration {p.iteration}", "",
                  f"Fitness {p.fitness:.4f}× ({verdict})."
                  + (f" Crossed with `{p.second_parent_id}`." if p.second_parent_id else "")
                  + (f" Beside the best of its time: {duel_phrase(p, crowned or {})}." if i
                     else ""), ""]
        if p.change.strip():
            ticks = "````" if "```" in p.change else "```"   # a fence the text cannot close
            lang = "diff" if _looks_like_diff(p.change) else "text"
            lines += [f"{ticks}{lang}", p.change.rstrip(), ticks, ""]
    return "\n".join(lines)


def _looks_like_diff(text: str) -> bool:
    return any(ln.startswith(("--- ", "+++ ", "@@", "<<<<<<< SEARCH")) for ln in text.splitlines())


def board_entry(rank: int, p: Program, exported: bool = False) -> dict[str, Any]:
    """Returns one leaderboard row as JSON data (exported: the row is the run's best)."""
    return {"rank": rank, "id": p.id, "fitness": p.fitness, "exported": exported,
            "verdict": p.result.verdict.value if p.result else None,
            "mutator": p.mutator, "iteration": p.iteration,
            "timing_device": p.result.timing_device if p.result else None,
            "speedups": [{"config": label(c.params), "params": c.params,
                          "dtype": c.dtype, "speedup": c.speedup, "ms": c.ms,
                          "baseline_ms": c.baseline_ms} for c in _configs(p)]}


def leaderboard_md(board: list[tuple[int, Program]], best_id: str = "") -> str:
    """Returns the leaderboard table from (rank, program) rows: one row a program, one column
    a config; the exported best (best_id) is marked, and a row above it is said to be
    unconfirmed."""
    labels: list[str] = []
    for _, p in board:
        for c in _configs(p):
            if label(c.params) not in labels:
                labels.append(label(c.params))
    head = ["rank", "id", "fitness", "verdict", "mutator", "iteration"] + labels
    lines = ["# Leaderboard", "", "Top correct programs by the fitness of their own "
             "evaluation; speedups are baseline time / candidate time per config.", ""]
    if best_id and board and board[0][1].id != best_id:
        lines += [f"The exported best is `{best_id}`, the run's champion (**best**). A program "
                  "ranked above it read faster only in its own evaluation: re-measured beside "
                  "the best it was not faster beyond noise, or its own interval already "
                  "reached the best's figure and it was not re-measured.", ""]
    if any(p.result and p.result.timing_device == "cpu" for _, p in board):
        lines += ["**Timed on CPU**: these speedups say nothing about GPU performance.", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rank, p in board:
        speed = {label(c.params): c.speedup for c in _configs(p)}
        cells = [str(rank), f"`{p.id}`" + (" (**best**)" if p.id == best_id else ""),
                 f"{p.fitness:.4f}",
                 p.result.verdict.value if p.result else "", p.mutator, str(p.iteration)]
        cells += [f"{speed[l]:.3f}×" if speed.get(l) is not None else "—" for l in labels]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---- README -----------------------------------------------------------------------
def readme(best: Program, info: KernelInfo,
           beside_seed: tuple[str, EvalResult] | None = None,
           set_back: dict[str, Any] | None = None) -> str:
    """Returns the export's README: what it is, install, use, guard, timings (and, where the
    run holds them, the changes it set back at its end and its re-measurement beside its
    seed), re-check."""
    r = best.result
    problem = info.problem
    where = f"{r.device} ({r.timing_device} timings)" if r else "unknown device"
    lines = [f"# Exported kernel `{best.id}`", "",
             f"The best correct program of an evoattn run (problem `{problem}`): fitness "
             f"{best.fitness:.4f}× (geometric-mean speedup over the baseline, "
             f"{r.timing if r else 'call'} timing), measured on {where}. `best_eval.json` holds "
             "the full evaluation, `lineage.md` how it was reached, `leaderboard.md` the "
             "runners-up.", ""]
    if r and r.timing_device == "cpu":
        lines += ["**These timings were taken on CPU** and say nothing about GPU speed: "
                  "re-check on a GPU before relying on it.", ""]
    lines += _install(info) + (_usage(info) if info.has_op else _no_op(info))
    lines += (_guard(info) + _set_back(set_back) + _beside_seed(best, beside_seed)
              + timings_md(r) + _files(best, info))
    return "\n".join(lines)


def _set_back(record: dict[str, Any] | None) -> list[str]:
    """The run's end: each change from the seed set back in a duel beside the best it had
    (prune.py), and whether it stayed set back."""
    if not record:
        return []
    lines = ["## Changes set back at the end of the run", "",
             f"Each knob in which the run's best (`{record['before']}`) differed from the seed "
             "was set back to the seed's value, one at a time, in a duel beside that best "
             "(`set_back.json`); a change stays only where setting it back costs beyond noise "
             "(in the fitness, or by 3% or more at a config in any mode):", ""]
    return lines + ["```text", *set_back_lines(record), "```", ""]


def _beside_seed(best: Program, beside_seed: tuple[str, EvalResult] | None) -> list[str]:
    """The run's seed and this best re-measured side by side at the end of the run: every
    mode, and the configs where the best is slower beyond noise."""
    if beside_seed is None:
        return []
    seed_id, duel = beside_seed
    return ["## Beside the run's seed", "",
            "At the end of the run the seed and this program were timed in the same rounds "
            "in one process (`side_by_side.json`):", "", "```text",
            *side_by_side_lines(duel, seed_id, best.id), "```", ""]


def _install(info: KernelInfo) -> list[str]:
    return ["## Install", "",
            f"This directory is a Python package, `{info.names.dist}` (import name "
            f"`{info.names.package}`):", "", "```sh", "pip install path/to/this/directory",
            "pip install \"path/to/this/directory[hf]\"   # with transformers", "```", "",
            "It needs torch (and triton for a Triton kernel). A kernel with CUDA files is "
            "built with nvcc on its first call, into `~/.cache/evoattn-kernels` (set "
            "`EVOATTN_KERNEL_CACHE` to move it). The first `attention()` call also starts "
            "building, in the background and into the same cache, the package's C++ call path "
            "(`_callkey.cpp`: a call's key, lookup and dispatch, a few µs less per eager call "
            "than the Python path; it needs a C++ compiler and ninja, about 15 s once per torch "
            "and Python): calls take the Python path until it is loaded, and wherever it "
            "cannot be built. A process that exits first stops the build; "
            "`call_path(wait_s=None)` builds it (once for all later processes) and says which "
            "path calls take; `EVOATTN_NATIVE=0` turns the C++ path off.", ""]


def _usage(info: KernelInfo) -> list[str]:
    pkg, ns = info.names.package, info.names.namespace
    user = info.meta["user_problem"]
    problem = _problem(info)
    docs = problem.op_docs if problem else None
    call, replaces, shapes, raw = (docs.call, docs.replaces, docs.shapes, docs.raw_args) \
        if docs else ("attention(...)", "", "", "...")
    lines = ["## Use it", "", f"`{pkg}.attention` is the custom op `torch.ops.{ns}.attention`"
             + (f" with the schema `{info.meta['schema']}`" if user else "") + ": it works "
             "eagerly, under `torch.compile(fullgraph=True)` with no graph break, and inside "
             "CUDA graphs (`mode=\"reduce-overhead\"`).", "",
             "```python", "import torch", f"from {pkg} import attention", "",
             *([f"# {shapes}"] if shapes else []), f"out = {call}",
             f"out = torch.ops.{ns}.attention(q, k, v, {raw})",
             "", "fast = torch.compile(model, fullgraph=True)   # the op stays one node", "```", ""]
    if user:
        lines += ["For a user-defined problem the op's schema is read from the kernel's "
                  "entry signature; its output is taken to have the shape and dtype of the "
                  "first tensor argument, and there is no PyTorch fallback: outside the "
                  "verified set the op raises NotImplementedError.", ""]
        return lines
    module = [] if docs and not docs.in_module else [
              "### In an `nn.Module`", "", "```python", "import torch",
              f"from {pkg} import attention", "",
              "class SelfAttention(torch.nn.Module):",
              "    def __init__(self, dim, heads):",
              "        super().__init__()",
              "        self.heads = heads",
              "        self.qkv = torch.nn.Linear(dim, 3 * dim)",
              "        self.proj = torch.nn.Linear(dim, dim)", "",
              "    def forward(self, x):                       # x: (B, S, dim)",
              "        B, S, C = x.shape",
              "        q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads)"
              ".permute(2, 0, 3, 1, 4)",
              f"        y = {call}" + (f"   # was {replaces}" if replaces else ""),
              "        return self.proj(y.transpose(1, 2).reshape(B, S, C))", "```", ""]
    lines += module + [
              "### In a Hugging Face transformers model", "", "```python",
              "from transformers import AutoModelForCausalLM",
              f"from {pkg} import hf", "",
              "hf.register(\"evoattn\")   # AttentionInterface.register(\"evoattn\", "
              "hf.attention_forward), and its mask function",
              "model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=\"evoattn\")",
              "```", "",
              "`hf.attention_forward(module, query, key, value, attention_mask, scaling=None, "
              "dropout=0.0, sliding_window=None, is_causal=None, **kwargs)` takes transformers' "
              "(B, H, S, D) inputs (GQA-shaped k, v too) and returns (B, S, H, D). Calls the "
              "kernel does not cover (" + (docs.hf_declines if docs else
                                           OpDocs("", "", "").hf_declines)
              + ", dropout while training) run transformers' SDPA path, or the model's own "
              "eager attention where they pass what SDPA lacks (softcap, attention sinks, "
              "output_attentions), counted in `stats()` with the reason; `hf.py` lists them.",
              ""]
    if docs and docs.notes:
        lines += [docs.notes, ""]
    return lines


def _problem(info: KernelInfo) -> Problem | None:
    """Returns the built-in problem an export is of (its docs, why it has no op), or None."""
    known = not info.meta["user_problem"] and info.problem in builtin_names()
    return get_problem(info.problem) if known else None


def _no_op(info: KernelInfo) -> list[str]:
    why = ("its entry signature has no torch.library schema form (*args, **kwargs or "
           "non-literal defaults)" if info.meta["user_problem"] else
           getattr(_problem(info), "no_op_reason", "")
           or f"no op form is known for problem {info.problem}")
    return ["## Use it", "", f"This kernel is not wrapped as a custom op: {why}. Load it with "
            f"`{info.names.package}.load_kernel_module()` (a Python kernel) and call its "
            f"`{info.meta['entry']}` as the problem's contract says.", ""]


def _guard(info: KernelInfo) -> list[str]:
    v = info.meta["verified"]
    # the guard serves the kernel on CUDA GPUs only: say so, not the device the run used
    where = ("CUDA GPUs" + (f" of compute capability {', '.join(v['capabilities'])} "
                            f"({v['device_name']})" if v["capabilities"] else "")
             + "; calls on the CPU fall back" if v["device_type"] == "cuda" else
             "none: every call falls back, on the CPU too (the kernel runs on CUDA GPUs only, "
             "and this run verified it on no GPU)")
    lines = ["## Where it runs", "",
             "The op runs the evolved kernel only on what its evaluation verified, and PyTorch "
             "SDPA elsewhere (logged once per reason at debug level on the logger "
             f"`{info.names.package}`; `{info.names.package}.stats()` counts both):", "",
             f"- device: {where}", f"- dtypes: {', '.join(v['dtypes']) or 'none'}"]
    if v["head_dims"]:
        lines.append(f"- head dims: {', '.join(map(str, v['head_dims']))}")
    if v["causal"] is not None:
        lines.append(f"- causal: {', '.join(map(str, v['causal']))}")
    lines += ["- shapes: the problem's contract (checked on odd sequence lengths too), up to "
              "2**31 elements per tensor",
              "- layout: strided inputs (transformers' (B, S, H, D) views) and k, v with fewer "
              "heads go to the kernel as they lie when its INPUT_LAYOUTS says it takes them and "
              "it gives on them, at the first call of that layout, what it gives on contiguous "
              "copies; otherwise it gets the copies. The op's output is contiguous; an eager "
              "`attention()` call returns the kernel's as it comes (the default seed lays it "
              "out as q, as SDPA does)",
              "- each call key (shapes, strides, dtypes, devices, arguments) is decided once; "
              "a repeated call looks its decision up",
              "- autograd: inputs that require grad take SDPA (the kernel is forward-only)",
              "", "A kernel that cannot be built or imported on a machine (no nvcc, say) is "
              "reported once as a warning, and every call runs SDPA.", "",
              f"`{info.names.package}.use_kernel(False)` (or `with {info.names.package}"
              ".kernel_off():`) switches the kernel off: every call then runs the fallback (or "
              "raises NotImplementedError where the problem has none), "
              "counted with the reason \"kernel switched off\", while everything else (the op, "
              "the Hugging Face integration and its mask function) stays as it is, so a model "
              "timed both ways shows what the kernel itself gains. Each setting keeps its own "
              "decisions (switching back and forth decides nothing twice); compiled graphs "
              "follow it, CUDA graphs captured before replay what they captured.", ""]
    if v["device_type"] == "cpu":
        lines += ["This run verified the kernel in CPU mode (Triton's interpreter, too slow to "
                  "serve), so the op always falls back; export a run made on a CUDA GPU to "
                  "serve it.", ""]
    return lines


def timings_md(r: EvalResult | None) -> list[str]:
    """Returns per-config timing tables, one row per config, in every timing mode."""
    if r is None or not r.configs:
        return []
    device = f"{r.device}" + (" (CPU timings)" if r.timing_device == "cpu" else "")
    versions = ", ".join(f"{k} {v}" for k, v in r.versions.items())
    lines = ["## Measured timings", "",
             f"On {device}" + (f", versions {versions}" if versions else "") + ". "
             "Times in ms (median); speedup = baseline / kernel; the baseline is the fastest "
             "PyTorch option per config unless the run named one. Fitness used the "
             f"`{r.timing}` mode.", ""]
    for mode in MODES:
        lines += [f"### {MODE_WORDS[mode]}", "",
                  "| config | dtype | evolved ms | baseline | baseline ms | speedup |",
                  "|---|---|---|---|---|---|"]
        for c in r.configs:
            mine = c.times.in_mode(mode) if c.times else None
            base = c.baseline_times.get(c.baseline_name)
            theirs = base.in_mode(mode) if base else None
            speed = f"{theirs / mine:.3f}×" if mine and theirs else "—"
            lines.append(f"| {label(c.params)} | {c.dtype} | {_ms(mine)} | "
                         f"{c.baseline_name or '—'} | {_ms(theirs)} | {speed} |")
        errors = sorted({c.times.graph_error for c in r.configs if c.times and c.times.graph_error})
        if mode == "graph" and errors:
            lines += ["", "Not captured in a CUDA graph: " + "; ".join(errors)]
        bound = host_bound_labels(r) if mode == "call" else []
        if bound:
            lines += ["", "Host-bound in call time (the calls issued at about their rate: these "
                      "ratios compare launch paths and move with the host's speed): "
                      + ", ".join(bound) + "."]
        lines.append("")
    return lines


def _ms(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "—"


def _files(best: Program, info: KernelInfo) -> list[str]:
    problem = "" if info.problem == DEFAULTS.problem else f" --problem {info.problem}"
    return ["## What is here", "",
            f"- `{info.names.package}/`: the package; `kernel/` holds the program's files, "
            "`kernel.json` what the op reads (names, form, verified set), `evidence/` the "
            "evaluation and lineage",
            f"- `best{best.suffix}`" + (" and its companion files" if len(info.files.files) > 1
                                        else "") + ": the kernel as the run evaluated it",
            "- `best_eval.json`, `lineage.md`/`.json`, `leaderboard.md`/`.json` (and "
            "`side_by_side.json` where the run re-measured it beside its seed, `set_back.json` "
            "where it set changes back at its end): the evidence",
            "", "## Re-check it", "",
            "Re-evaluate on your own GPU (correctness first, then timing against PyTorch):",
            "", "```sh", f"evoattn eval best{best.suffix}{problem}", "```", ""]
