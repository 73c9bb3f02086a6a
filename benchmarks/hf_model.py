"""An exported kernel inside a Hugging Face Llama model: what the kernel gains, what the
integration gains, logits agreement.

    python -m benchmarks.hf_model --export RUN_DIR/best --device cuda --compile \\
        --hidden 2048,4096 --seqs 1000,3000,6000 --dtypes float16,bfloat16 --json hf_model.json
    python -m benchmarks.hf_model --export RUN_DIR/best --device cpu --tiny   # the CPU check

Builds a Llama-architecture model from a config with random weights (no download) per
--hidden: 32 query heads and 8 kv heads (GQA 4:1), so hidden 2048 has head dim 64 and 4096 has
128; MLP as Llama 3.2 1B (8192) and Llama 3.1 8B (14336), 4x hidden otherwise; vocab 32000;
--layers decoder layers (default 4). Registers the export with transformers'
AttentionInterface and, per hidden size, dtype and sequence length (batch 1), times three rows
of one prefill forward as generation runs it (use_cache=True: a fresh DynamicCache each call;
logits_to_keep=1: the LM head on the last position only, so a 32000-word head over every
position does not bury the layers; the agreement check takes every position's logits):
  a  attn_implementation="sdpa", transformers' own
  b  "evoattn" with the kernel switched off (PACKAGE.use_kernel(False)): the package's
     fallback (PyTorch SDPA) behind its own integration and mask function
  c  "evoattn" as shipped: the kernel
and reports
  kernel gain       time(b) / time(c): what the kernel alone gains the forward (the same
                    integration around it)
  integration gain  time(a) / time(b): the package's integration against transformers' own
                    (speedup, time(a) / time(c), is their product)
  latency           median of --runs forwards after --warmup (each run's time is kept), CUDA
                    events on a GPU, rows a, b and c timed in interleaved rounds (one forward
                    of each per round, the order reversed every round); eager, and under torch.compile(fullgraph=True) with
                    --compile (rows b and c share one graph: the op decides when it runs)
  cross-check       with --cross-check N (GPU): the kernel gain again by triton.testing.do_bench,
                    rows b and c taking turns for N rounds (no timing code shared with the above)
  attention share   of one extra untimed eager forward: the time inside the attention function
                    (each call between two CUDA events, or perf_counter on the CPU; the events
                    themselves cost a little) over that forward's time
  calls             how many attention calls of one forward reached the kernel and how many fell
                    back, with the reasons (the package's counter; under compile, calls the
                    integration refuses are not counted). Every prefill call of row c should
                    reach the kernel: a WARNING line on stderr names any that fell back
  agreement         logits of each row against a float32 reference of the same weights: b and c
                    pass when their max abs difference is within 2x a's and their top-1
                    agreement at most 1 point below a's (random weights make near ties, which
                    two correct roundings flip either way: an absolute top-1 figure means little)
The kernel and integration gains are per-layer properties, so fewer layers than the real model
are fine: only the LM head and the embedding, a cost fixed per forward, dilute them a little
more the fewer the layers. The attention share is not: it moves with --layers. The default 4
keeps a run of every row short; --compile adds one graph per dtype, implementation and (without
--dynamic) shape. --no-cache times the training-style forward (use_cache=False): under
torch.compile, transformers then builds an explicit mask for every implementation (it cannot
rule out packed sequences in position_ids while tracing), so evoattn falls back to SDPA there,
uncounted.
--tiny is a 2-layer model with 4 heads and 2 kv heads (hidden 64: head dim 16) for the CPU,
where the kernel never runs: rows b and c both time the fallback (the output says so).
"""
from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import interleaved_samples

# (label, attn_implementation, kernel switched on) of the three rows
ROWS = (("a", "sdpa", True), ("b", "evoattn", False), ("c", "evoattn", True))
MLP = {2048: 8192, 4096: 14336}        # Llama 3.2 1B, Llama 3.1 8B; 4x hidden otherwise


def load_export(path: str) -> Any:
    """Imports the package of an export directory (or a run directory's `best/`) by path."""
    root = Path(path)
    if (root / "run.sqlite").is_file():
        root = root / "best"
    manifest = json.loads((root / "export.json").read_text())
    name = manifest["package"]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, root / name / "__init__.py", submodule_search_locations=[str(root / name)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"{root}: no package {name} in this export")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def model_config(hidden: int, a: argparse.Namespace) -> Any:
    """Returns the LlamaConfig of one hidden size (heads, layers and vocab from the flags)."""
    from transformers import LlamaConfig
    mlp = 2 * hidden if a.tiny else MLP.get(hidden, 4 * hidden)
    return LlamaConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=a.layers,
                       num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                       head_dim=hidden // a.heads, vocab_size=a.vocab, tie_word_embeddings=True,
                       max_position_embeddings=max(a.seqs))


_T0 = time.perf_counter()


def say(what: str) -> None:
    """Progress on stderr with the seconds since start (the first compile takes minutes)."""
    print(f"[{time.perf_counter() - _T0:6.1f}s] {what}", file=sys.stderr, flush=True)


def use(model: Any, name: str) -> None:
    """Switches a model's attention implementation."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:                               # older transformers
        model.config._attn_implementation = name


class Clock:
    """Marks points in time: CUDA events on a GPU, perf_counter on the CPU (milliseconds)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        """Returns a point in time (on a GPU, an event recorded on the current stream)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def between(self, start: Any, end: Any) -> float:
        """Returns the milliseconds from one mark to a later one (waiting for the GPU)."""
        if not self.cuda:
            return (end - start) * 1e3
        end.synchronize()
        return start.elapsed_time(end)

    def ms(self, fn: Callable[[], Any]) -> float:
        """Returns the milliseconds one call of fn takes."""
        start = self.mark()
        fn()
        return self.between(start, self.mark())


def attention_time(forward: Callable[[], Any], impl: str, clock: Clock,
                   only: Callable[[torch.Tensor], bool] | None = None) -> tuple[float, float]:
    """Returns (ms inside the attention function, ms of the forward) of one forward, with the
    implementation's entry in transformers' AttentionInterface wrapped in clock marks; with
    `only`, just the calls whose query it accepts are timed."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as functions
    inner, spans = functions[impl], []

    def timed(*args: Any, **kwargs: Any) -> Any:
        if only is not None and not only(args[1]):              # (module, query, key, ...)
            return inner(*args, **kwargs)
        start = clock.mark()
        out = inner(*args, **kwargs)
        spans.append((start, clock.mark()))
        return out

    local = getattr(functions, "_local_mapping", {})
    had = impl in local
    functions[impl] = timed                 # an override of this instance (its local mapping)
    try:
        forward_ms = clock.ms(forward)
    finally:
        # put back what was there: re-setting `inner` would leave a local override behind
        # that shadows every later registration of the name (a test's, another package's)
        if had:
            functions[impl] = inner
        else:
            del functions[impl]
    return sum(clock.between(s, e) for s, e in spans), forward_ms


def agreement(logits: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Returns max abs difference and top-1 agreement of logits against the reference."""
    diff = (logits.float() - ref).abs().max().item()
    top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return {"max_abs": diff, "top1": top1}


# Random weights make near ties: two correct kernels' roundings flip a few of them either way,
# so a top-1 agreement this far below SDPA's is still as close as SDPA's.
TOP1_SLACK = 0.01


def judge(sdpa: dict[str, float], evo: dict[str, float]) -> bool:
    """Returns whether evoattn agrees with the reference as closely as SDPA does: a max abs
    difference within 2x SDPA's, a top-1 agreement at most TOP1_SLACK below SDPA's."""
    return evo["max_abs"] <= 2 * sdpa["max_abs"] and evo["top1"] >= sdpa["top1"] - TOP1_SLACK


def switch(pkg: Any, model: Any, impl: str, kernel: bool) -> None:
    """Makes a model run one row: its attention implementation, the package's kernel on/off."""
    use(model, impl)
    pkg.use_kernel(kernel)


def prepare(pkg: Any, model: Any, impl: str, kernel: bool, forward: Callable[[], Any],
            timed: Callable[[], Any], ref: torch.Tensor, a: argparse.Namespace
            ) -> dict[str, Any]:
    """Checks one row (agreement over every position's logits, the package's call counts)
    and warms up what is timed."""
    switch(pkg, model, impl, kernel)
    pkg.reset_stats()
    r: dict[str, Any] = {"impl": impl, "kernel_on": kernel,
                         **agreement(forward().logits, ref), "calls": pkg.stats(),
                         "runs_ms": []}
    for _ in range(a.warmup):
        timed()
    return r


def measure_rows(pkg: Any, model: Any, ids: torch.Tensor, ref: torch.Tensor, clock: Clock,
                 a: argparse.Namespace, share: bool, say_row: Callable[[str], None]
                 ) -> dict[str, dict[str, Any]]:
    """Measures rows a, b and c of one model: each checked and warmed up, then timed in
    interleaved rounds (one forward of each row per round, the order reversed every round),
    so a drift in the GPU's clock or the host's speed falls on every row alike; with
    share=True (eager only), the attention share of each row."""
    def forward() -> Any:                  # every position's logits: the agreement check
        return model(ids, use_cache=a.cache)

    def prefill() -> Any:                  # the last position's only, as generate's prefill
        return model(ids, use_cache=a.cache, logits_to_keep=1)

    got: dict[str, dict[str, Any]] = {}
    for label, impl, kernel in ROWS:
        say_row(f"row {label} ({impl}, kernel {'on' if kernel else 'off'})")
        got[label] = prepare(pkg, model, impl, kernel, forward, prefill, ref, a)
    def timed(row: tuple[str, str, bool]) -> float:
        switch(pkg, model, row[1], row[2])
        return clock.ms(prefill)
    for label, runs in interleaved_samples({row[0]: row for row in ROWS}, timed,
                                           a.runs).items():
        got[label]["runs_ms"] += runs
    if a.cross_check:
        got["do_bench"] = cross_check(pkg, model, prefill, a)
    for label, impl, kernel in ROWS:
        r = got[label]
        r["ms"] = statistics.median(r["runs_ms"])
        if share:
            switch(pkg, model, impl, kernel)
            r["attention_ms"], r["forward_ms"] = attention_time(prefill, impl, clock)
            r["attention_share"] = r["attention_ms"] / r["forward_ms"]
    return got


def cross_check(pkg: Any, model: Any, forward: Callable[[], Any],
                a: argparse.Namespace) -> dict[str, Any]:
    """The kernel gain again, by a harness that shares no timing code with Clock:
    triton.testing.do_bench (its own CUDA events, an L2 flush before each forward) of rows b
    and c, taking turns for --cross-check rounds; the gain is the median of the rounds'
    ratios, with their range."""
    import triton.testing
    def timed(row: tuple[str, str, bool]) -> float:
        switch(pkg, model, row[1], row[2])
        return triton.testing.do_bench(forward, warmup=50, rep=300, return_mode="median")
    ms = interleaved_samples({row[0]: row for row in ROWS[1:]}, timed, a.cross_check)
    ratios = [b / c for b, c in zip(ms["b"], ms["c"])]
    return {"b_ms": ms["b"], "c_ms": ms["c"], "kernel_gain": statistics.median(ratios),
            "kernel_gain_range": [min(ratios), max(ratios)]}


def run_seq(pkg: Any, models: dict[str, Any], ref_model: Any, seq: int,
            a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Measures one sequence length: rows a, b and c and their gains, eager (and compiled)."""
    gen = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, a.vocab, (a.batch, seq), generator=gen).to(device)
    clock = Clock(device)
    row: dict[str, Any] = {"seq": seq, "batch": a.batch}
    with torch.inference_mode():
        ref = ref_model(ids, use_cache=a.cache).logits.float()
        try:
            for mode, model in models.items():
                got = measure_rows(pkg, model, ids, ref, clock, a, share=mode == "eager",
                                   say_row=lambda what: say(f"S={seq} {mode} {what}"))
                row[mode] = {**got, "kernel_gain": got["b"]["ms"] / got["c"]["ms"],
                             "integration_gain": got["a"]["ms"] / got["b"]["ms"],
                             "speedup": got["a"]["ms"] / got["c"]["ms"],
                             "agrees": judge(got["a"], got["b"]) and judge(got["a"], got["c"])}
        finally:
            pkg.use_kernel(True)
        del ref
    return row


def run_hidden(pkg: Any, hidden: int, a: argparse.Namespace,
               device: torch.device) -> list[dict[str, Any]]:
    """Builds the model of one hidden size and measures every dtype and sequence length."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    config = model_config(hidden, a)
    config._attn_implementation = "sdpa"
    say(f"building the hidden-{hidden} model")
    with torch.device(device):
        ref_model = LlamaForCausalLM(config).eval()
    rows = []
    for dtype in a.dtypes:
        model = copy.deepcopy(ref_model).to(getattr(torch, dtype))
        models: dict[str, Any] = {"eager": model}
        if a.compile:
            models["compile"] = torch.compile(model, fullgraph=True, dynamic=a.dynamic or None)
        for seq in a.seqs:
            row = {"hidden": hidden, "head_dim": config.head_dim,
                   "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                   "layers": config.num_hidden_layers, "dtype": dtype,
                   **run_seq(pkg, models, ref_model, seq, a, device)}
            rows.append(row)
            for mode in models:
                print(line(row, mode), flush=True)
                warn_fallbacks(row, mode)
                if "do_bench" in row[mode]:
                    d = row[mode]["do_bench"]
                    print(f"  do_bench cross-check, hidden {hidden} {dtype} S={seq} {mode}: "
                          f"kernel gain b/c {d['kernel_gain']:.3f}x (rounds "
                          f"{d['kernel_gain_range'][0]:.3f}-{d['kernel_gain_range'][1]:.3f})",
                          flush=True)
        del models, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del ref_model
    return rows


def warn_fallbacks(row: dict[str, Any], mode: str) -> None:
    """Prints a WARNING line on stderr when any of row c's attention calls fell back."""
    calls = row[mode]["c"]["calls"]
    if calls["fallback"]:
        reasons = "; ".join(f"{n}x {why}" for why, n in calls["fallback_reasons"].items())
        print(f"WARNING: hidden {row['hidden']} {row['dtype']} S={row['seq']} {mode}: row c ran "
              f"the kernel in {calls['kernel']} attention calls and fell back in "
              f"{calls['fallback']}: {reasons}", file=sys.stderr, flush=True)


def line(row: dict[str, Any], mode: str) -> str:
    """Returns one markdown table row of one mode's results."""
    r = row[mode]
    share = "/".join(f"{r[x]['attention_share']:.0%}" for x in "abc") \
        if "attention_share" in r["a"] else "—"
    calls = r["c"]["calls"]
    cells = [str(row["hidden"]), str(row["head_dim"]), f"{row['heads']}/{row['kv_heads']}",
             row["dtype"], str(row["seq"]), mode,
             *(f"{r[x]['ms']:.2f}" for x in "abc"), f"{r['kernel_gain']:.3f}×",
             f"{r['integration_gain']:.3f}×", share, f"{calls['kernel']}/{calls['fallback']}",
             f"{r['c']['max_abs']:.3g} vs {r['a']['max_abs']:.3g}",
             "yes" if r["agrees"] else "NO"]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| hidden | D | heads/kv | dtype | S | mode | a sdpa ms | b fallback ms | c kernel ms | "
          "kernel gain b/c | integration gain a/b | attention share a/b/c | c kernel/fallback | "
          "max abs c vs a | agrees |\n" + "|---" * 15 + "|")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True, help="an export directory, or a run directory")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqs", default=None, help="comma-separated (default 1000,3000,6000)")
    ap.add_argument("--hidden", default=None,
                    help="comma-separated hidden sizes, 32 heads each (default 2048,4096)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtypes", default="float16,bfloat16", help="comma-separated")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(fullgraph=True)")
    ap.add_argument("--dynamic", action="store_true", help="compile with dynamic shapes")
    ap.add_argument("--no-cache", dest="cache", action="store_false",
                    help="time the training-style forward (use_cache=False)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 4-head model (CPU checks)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cross-check", type=int, default=0, metavar="N",
                    help="also time rows b and c by triton.testing.do_bench in N rounds (GPU)")
    ap.add_argument("--json", dest="json_path", help="write the results here")
    a = ap.parse_args(argv)
    if a.cross_check and a.device == "cpu":
        ap.error("--cross-check needs a GPU (triton.testing.do_bench)")
    size = dict(heads=4, kv_heads=2, layers=2, vocab=128, hidden="64", seqs="16,33") if a.tiny \
        else dict(heads=32, kv_heads=8, layers=4, vocab=32000, hidden="2048,4096",
                  seqs="1000,3000,6000")
    a.layers = a.layers or size["layers"]
    a.heads, a.kv_heads, a.vocab = size["heads"], size["kv_heads"], size["vocab"]
    a.hidden = [int(h) for h in (a.hidden or size["hidden"]).split(",")]
    a.seqs = [int(s) for s in (a.seqs or size["seqs"]).split(",")]
    a.dtypes = a.dtypes.split(",")
    for name in a.dtypes:
        if name not in ("float16", "bfloat16"):
            ap.error(f"--dtypes: {name} (float16, bfloat16)")
    for hidden in a.hidden:
        if hidden % a.heads:
            ap.error(f"--hidden: {hidden} is not a multiple of {a.heads} heads")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    import transformers
    device = torch.device(a.device)
    pkg = load_export(a.export)
    if not hasattr(pkg, "use_kernel"):
        raise SystemExit(f"{pkg.__name__} has no kernel switch (use_kernel): export it again")
    importlib.import_module(f"{pkg.__name__}.hf").register("evoattn")
    for limit in ("recompile_limit", "cache_size_limit"):   # one graph per impl and shape
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    note = None if device.type == "cuda" else \
        "On the CPU the kernel does not run (the guard serves CUDA only): rows b and c both " \
        "time the package's fallback."
    if note:
        print(note, flush=True)
    print(HEADER, flush=True)
    rows = [r for h in a.hidden for r in run_hidden(pkg, h, a, device)]
    modes = ("eager", "compile") if a.compile else ("eager",)
    result = {"note": note, "package": pkg.__name__, "program_id": pkg.PROGRAM_ID,
              "problem": pkg.PROBLEM,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "model": {"hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads,
                        "layers": a.layers, "vocab": a.vocab, "batch": a.batch},
              "dtypes": a.dtypes, "seqs": a.seqs, "compile": a.compile, "dynamic": a.dynamic,
              "use_cache": a.cache, "runs": a.runs, "warmup": a.warmup,
              "verified": pkg.VERIFIED, "rows": rows,
              "all_agree": all(r[m]["agrees"] for r in rows for m in modes),
              "all_on_kernel": all(r[m]["c"]["calls"]["fallback"] == 0 for r in rows
                                   for m in modes)}
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["all_agree"] else 1)
