"""An exported kernel inside a Hugging Face Llama model: logits agreement and prefill latency.

    python benchmarks/hf_model.py --export RUN_DIR/best --device cuda \\
        --seqs 512,1024,2048,4096,8192 --head-dims 64,128 --compile --json hf_model.json
    python benchmarks/hf_model.py --export RUN_DIR/best --device cpu --tiny   # the CPU check

Builds a Llama-architecture model from a config with random weights (no download), sized like
a 1B model (hidden 2048, 16 layers, MLP 8192, GQA 4:1; head dim 64 gives 32 heads, 128 gives
16), registers the export with transformers' AttentionInterface, and per head dim and
sequence length:
  agreement  logits of one float16 forward with attn_implementation="sdpa" and "evoattn", each
             against a float32 reference of the same weights: evoattn passes when its max abs
             difference is within 2x SDPA's own and its top-1 agreement is at least SDPA's own
             (random weights make near ties, so an absolute top-1 figure means little)
  calls      how many attention calls of one forward reached the kernel and how many fell back
             (the package's counter; eager, and compiled when --compile)
  latency    one prefill forward, as generation runs it (use_cache=True: a fresh DynamicCache
             each call; the same call as the agreement check, so a compiled model needs one
             graph per implementation), timed both ways: median of --runs after --warmup,
             CUDA events on a GPU; eager, and under torch.compile(fullgraph=True) with
             --compile. --no-cache times the training-style forward (use_cache=False) instead:
             under torch.compile, transformers then builds an explicit mask for every
             implementation (it cannot rule out packed sequences in position_ids while
             tracing), so evoattn falls back to SDPA there, uncounted (see the package's
             stats())
--tiny is a 2-layer model with 4 heads of each head dim (hidden 64 at the default head dim 16)
for the CPU, where every call runs the SDPA fallback.
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
from typing import Any

import torch


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


def model_config(head_dim: int, a: argparse.Namespace) -> Any:
    """Returns the LlamaConfig of one head dim (sized by the flags)."""
    from transformers import LlamaConfig
    hidden = a.tiny_heads * head_dim if a.tiny else a.hidden
    heads = hidden // head_dim
    return LlamaConfig(hidden_size=hidden, intermediate_size=a.mlp_ratio * hidden, num_hidden_layers=a.layers,
                       num_attention_heads=heads, num_key_value_heads=max(1, heads // a.kv_ratio),
                       head_dim=head_dim, vocab_size=a.vocab, tie_word_embeddings=True,
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
    """Times one call: CUDA events on a GPU, perf_counter on the CPU (milliseconds)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def ms(self, fn: Any) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)


def median_ms(fn: Any, clock: Clock, warmup: int, runs: int) -> float:
    """Returns the median time of `runs` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(clock.ms(fn) for _ in range(runs))


def agreement(logits: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Returns max abs difference and top-1 agreement of logits against the reference."""
    diff = (logits.float() - ref).abs().max().item()
    top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return {"max_abs": diff, "top1": top1}


def judge(sdpa: dict[str, float], evo: dict[str, float]) -> bool:
    """Returns whether evoattn agrees with the reference as closely as SDPA does."""
    return evo["max_abs"] <= 2 * sdpa["max_abs"] and evo["top1"] >= sdpa["top1"]


def run_seq(pkg: Any, models: dict[str, Any], ref_model: Any, seq: int,
            a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Measures one sequence length: agreement, call counts and latency, both ways."""
    gen = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, a.vocab, (a.batch, seq), generator=gen).to(device)
    clock = Clock(device)
    with torch.inference_mode():
        ref = ref_model(ids, use_cache=a.cache).logits.float()
        row: dict[str, Any] = {"seq": seq, "batch": a.batch}
        for mode, model in models.items():
            got: dict[str, Any] = {}
            for impl in ("sdpa", "evoattn"):
                say(f"S={seq} {mode} {impl}")
                use(model, impl)
                pkg.reset_stats()
                got[impl] = agreement(model(ids, use_cache=a.cache).logits, ref)
                got[impl]["calls"] = pkg.stats()
                got[impl]["ms"] = median_ms(lambda: model(ids, use_cache=a.cache), clock,
                                            a.warmup, a.runs)
            row[mode] = {"sdpa_ms": got["sdpa"]["ms"], "evoattn_ms": got["evoattn"]["ms"],
                         "speedup": got["sdpa"]["ms"] / got["evoattn"]["ms"],
                         "sdpa": got["sdpa"], "evoattn": got["evoattn"],
                         "agrees": judge(got["sdpa"], got["evoattn"]),
                         "kernel_calls": got["evoattn"]["calls"]["kernel"],
                         "fallback_calls": got["evoattn"]["calls"]["fallback"]}
        del ref
    return row


def run_head_dim(pkg: Any, head_dim: int, a: argparse.Namespace,
                 device: torch.device) -> list[dict[str, Any]]:
    """Builds the model of one head dim and measures every sequence length."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    config = model_config(head_dim, a)
    config._attn_implementation = "sdpa"
    say(f"building the head-dim-{head_dim} model")
    with torch.device(device):
        ref_model = LlamaForCausalLM(config).eval()
    model = copy.deepcopy(ref_model).to(getattr(torch, a.dtype))
    models: dict[str, Any] = {"eager": model}
    if a.compile:
        models["compile"] = torch.compile(model, fullgraph=True, dynamic=a.dynamic or None)
    rows = []
    for seq in a.seqs:
        row = run_seq(pkg, models, ref_model, seq, a, device)
        row.update(head_dim=head_dim, heads=config.num_attention_heads,
                   kv_heads=config.num_key_value_heads, layers=config.num_hidden_layers)
        rows.append(row)
        print(line(row), flush=True)
    del models, model, ref_model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def line(row: dict[str, Any]) -> str:
    """Returns one markdown table row of results."""
    cells = [str(row["head_dim"]), f"{row['heads']}/{row['kv_heads']}", str(row["batch"]),
             str(row["seq"])]
    for mode in ("eager", "compile"):
        r = row.get(mode)
        if r is None:
            cells += ["—"] * 4
            continue
        cells += [f"{r['sdpa_ms']:.2f}", f"{r['evoattn_ms']:.2f}", f"{r['speedup']:.3f}×",
                  f"{r['kernel_calls']}/{r['fallback_calls']}"]
    e = row["eager"]
    cells += [f"{e['evoattn']['max_abs']:.3g} vs {e['sdpa']['max_abs']:.3g}",
              f"{e['evoattn']['top1']:.4f} vs {e['sdpa']['top1']:.4f}",
              "yes" if all(row[m]["agrees"] for m in ("eager", "compile") if m in row) else "NO"]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| D | heads/kv | B | S | eager sdpa ms | eager evoattn ms | eager speedup | "
          "eager kernel/fallback | compiled sdpa ms | compiled evoattn ms | compiled speedup | "
          "compiled kernel/fallback | max abs (evoattn vs sdpa) | top-1 (evoattn vs sdpa) | "
          "agrees |\n" + "|---" * 15 + "|")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True, help="an export directory, or a run directory")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqs", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--head-dims", default=None, help="comma-separated (default 64,128)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(fullgraph=True)")
    ap.add_argument("--dynamic", action="store_true", help="compile with dynamic shapes")
    ap.add_argument("--no-cache", dest="cache", action="store_false",
                    help="time the training-style forward (use_cache=False)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 4-head model (CPU checks)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", dest="json_path", help="write the results here")
    a = ap.parse_args(argv)
    # --tiny: 4 heads of each head dim (hidden 64 at head dim 16), 2 layers, GQA 2:1.
    size = dict(hidden=None, tiny_heads=4, mlp_ratio=2, layers=2, kv_ratio=2, vocab=128) \
        if a.tiny else dict(hidden=2048, mlp_ratio=4, layers=16, kv_ratio=4, vocab=32000)
    for k, v in size.items():
        setattr(a, k, v)
    a.seqs = [int(s) for s in (a.seqs or ("16,33" if a.tiny else "512,1024,2048,4096,8192"))
              .split(",")]
    a.head_dims = [int(d) for d in (a.head_dims or ("16" if a.tiny else "64,128")).split(",")]
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    import transformers
    device = torch.device(a.device)
    pkg = load_export(a.export)
    importlib.import_module(f"{pkg.__name__}.hf").register("evoattn")
    for limit in ("recompile_limit", "cache_size_limit"):   # one graph per impl and shape
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    print(HEADER, flush=True)
    rows = [r for d in a.head_dims for r in run_head_dim(pkg, d, a, device)]
    result = {"package": pkg.__name__, "program_id": pkg.PROGRAM_ID, "problem": pkg.PROBLEM,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "model": {k: getattr(a, k) for k in ("hidden", "mlp_ratio", "layers", "kv_ratio",
                                                   "vocab", "batch", "dtype")},
              "compile": a.compile, "dynamic": a.dynamic, "use_cache": a.cache,
              "runs": a.runs, "warmup": a.warmup,
              "verified": pkg.VERIFIED, "rows": rows,
              "all_agree": all(r[m]["agrees"] for r in rows for m in ("eager", "compile")
                               if m in r)}
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["all_agree"] else 1)
