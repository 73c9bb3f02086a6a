"""One decode step of a Llama-shaped model over a static KV cache, SDPA against an exported
`decode` kernel: the cross-check of decode_generate.py's tokens per second by another harness.

    python -m benchmarks.decode_step --export RUN_DIR/best --out step.json
    python -m benchmarks.decode_step --export RUN_DIR/best --device cpu --tiny --out s.json

The model is decode_generate.py's (hidden 2048, 16 layers, GQA 4:1, random weights; --tiny on
the CPU). Per dtype, a StaticCache of --prompt + --new positions is filled by one forward of
--batch random prompts (SDPA); then one step, the forward of one new token per sequence at
position --prompt + --at, is timed for each implementation:
  eager      the forward as it is, given what a user's own loop passes (cache_position,
             position_ids, a 2-D mask of ones; the cache set back before each step, two small
             device ops in both implementations' time, so every step writes the same slot)
  compiled   torch.compile(forward, fullgraph=True, mode="reduce-overhead") of our own (CUDA
             graphs on a GPU; what generate's compile config asks for), each implementation
             on its own copy of the model, given what generate passes a static cache's
             compiled steps: the attention mask built from the 2-D one before the compiled
             forward, outside its trace (transformers' create_masks_for_generate, as
             generate's prepare_inputs_for_generation calls it; for the kernel the cache's
             lengths, for SDPA a mask over the whole cache). A 2-D mask handed to the
             compiled forward itself sends a padded-or-not question into the trace, which
             the package leaves to SDPA. The evoattn step's op calls before the replays are
             counted: with none, that mode times SDPA on both sides, and the script warns
Timing: triton.testing.do_bench (median; its own CUDA events and L2 flush) and a plain loop
of --loop steps between two device syncs, host clock, the implementations taking turns for
--rounds rounds (order reversed every round); the speedup is the median of the rounds'
ratios, with their range, and tokens/s = batch / step time. Each eager step's attention calls
are counted (every layer's should reach the kernel); compiled replays run no Python and are
not. The outputs of the two implementations' steps are compared (largest logit difference).
"""
from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import interleaved_samples, sync
from benchmarks.decode_generate import (IMPLS, build_model, cache_keyword, decode_package,
                                        model_args)


def loop_ms(step: Callable[[], Any], n: int) -> float:
    """Host time of n back-to-back steps between two syncs, per step (ms)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    return (time.perf_counter() - t0) * 1e3 / n


def bench_ms(step: Callable[[], Any], device: torch.device) -> float | None:
    """triton.testing.do_bench's median (GPU only)."""
    if device.type != "cuda":
        return None
    import triton.testing
    return triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")


def forward_kwargs(model: Any, cache: Any, pos: torch.Tensor) -> dict[str, Any]:
    """The cache (by the name this transformers gives it) and, where forward still takes it,
    cache_position."""
    kw = {cache_keyword(model): cache}
    if "cache_position" in inspect.signature(model.forward).parameters:
        kw["cache_position"] = pos
    return kw


def prefilled(model: Any, ids: torch.Tensor, total: int) -> Any:
    """A StaticCache of `total` positions holding the prompt's keys and values (SDPA)."""
    from transformers import StaticCache
    cache = StaticCache(config=model.config, max_cache_len=total)
    model.set_attn_implementation("sdpa")
    model(ids, use_cache=True, logits_to_keep=1, attention_mask=torch.ones_like(ids),
          **forward_kwargs(model, cache, torch.arange(ids.shape[1], device=ids.device)))
    return cache


def rewinder(cache: Any, pos: int) -> Callable[[], None]:
    """Returns what puts the cache back at `pos` tokens, so that every timed step writes the
    same slot: transformers >= 5.2x place a static cache's update at a per-layer counter
    (a tensor, set back by two fused device ops), older ones at cache_position (nothing to do)."""
    layers = getattr(cache, "layers", [])
    counters = [lay.cumulative_length for lay in layers
                if isinstance(getattr(lay, "cumulative_length", None), torch.Tensor)]
    ints = [lay for lay in layers if isinstance(getattr(lay, "cumulative_length", None), int)]

    def rewind() -> None:
        if counters:
            torch._foreach_mul_(counters, 0)
            torch._foreach_add_(counters, pos)
        for lay in ints:
            lay.cumulative_length = pos
    return rewind


def generate_mask(model: Any, token: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """The attention mask generate passes a static cache's compiled step for kwargs' 2-D one:
    transformers' create_masks_for_generate (the model's own where it has one) called before
    the compiled forward, with the arguments prepare_inputs_for_generation gives it (their
    names vary across transformers versions, so they are matched to its signature)."""
    from transformers.masking_utils import create_masks_for_generate
    build = getattr(model, "create_masks_for_generate", create_masks_for_generate)
    cache = kwargs[cache_keyword(model)]
    given = {"config": model.config, "attention_mask": kwargs["attention_mask"],
             "inputs_embeds": torch.empty((*token.shape, 0), dtype=model.dtype,
                                          device=token.device),
             "cache": cache, "past_key_values": cache, "position_ids": kwargs["position_ids"],
             "cache_position": kwargs.get("cache_position")}
    given["input_embeds"] = given["inputs_embeds"]
    params = inspect.signature(build).parameters
    return build(**{k: v for k, v in given.items() if k in params})


def compiled_step(model: Any, impl: str, token: torch.Tensor, kwargs: dict[str, Any],
                  rewind: Callable[[], None]) -> Callable[[], Any]:
    """One implementation's step compiled on a copy of the model of its own (set to that
    implementation before tracing: one compiled forward switched between implementations
    kept replaying one graph for both), sharing the weights' values and the cache, given the
    mask generate would give it (every timed step is the same position, so one mask serves)."""
    own = copy.deepcopy(model)
    own.set_attn_implementation(impl)
    mode = "reduce-overhead" if token.device.type == "cuda" else None
    compiled = torch.compile(own.forward, fullgraph=True, mode=mode)
    rewind()                         # the mask reads the cache's position: the step's own
    step_kwargs = {**kwargs, "attention_mask": generate_mask(own, token, kwargs)}

    def step() -> Any:
        rewind()
        return compiled(token, **step_kwargs).logits
    return step


def ratio_summary(t: dict[str, list[float]]) -> dict[str, Any]:
    ratios = [s / e for s, e in zip(t["sdpa"], t["evoattn"])]
    return {"sdpa_ms": statistics.median(t["sdpa"]), "evoattn_ms": statistics.median(t["evoattn"]),
            "sdpa_runs_ms": t["sdpa"], "evoattn_runs_ms": t["evoattn"],
            "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)]}


def run_dtype(pkg: Any, ref_model: Any, dtype: str, a: argparse.Namespace,
              device: torch.device) -> dict[str, Any]:
    model = copy.deepcopy(ref_model).to(getattr(torch, dtype))
    cfg = model.config
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(1, cfg.vocab_size, (a.batch, a.prompt), generator=gen).to(device)
    pos = a.prompt + a.at
    token = torch.randint(1, cfg.vocab_size, (a.batch, 1), generator=gen).to(device)
    row: dict[str, Any] = {"dtype": dtype, "batch": a.batch, "prompt": a.prompt, "at": a.at}
    with torch.no_grad():
        cache = prefilled(model, ids, a.prompt + a.new)
        rewind = rewinder(cache, pos)
        kwargs = {"use_cache": True, "position_ids": torch.full((a.batch, 1), pos, device=device),
                  "attention_mask": torch.ones(a.batch, pos + 1, dtype=torch.long,
                                               device=device),
                  **forward_kwargs(model, cache, torch.tensor([pos], device=device))}

        def eager() -> Any:
            rewind()
            return model(token, **kwargs).logits

        steps: dict[str, dict[str, Callable[[], Any]]] = \
            {"eager": {i: eager for i in IMPLS}} if a.eager else {}
        if a.compile:
            steps["compiled"] = {i: compiled_step(model, i, token, kwargs, rewind) for i in IMPLS}
        for mode, step_of in steps.items():
            logits = {}
            for impl in IMPLS:                       # checks, compiles, warms up
                model.set_attn_implementation(impl)
                step = step_of[impl]
                pkg.reset_stats()
                logits[impl] = step().float().clone()
                for _ in range(3):
                    step()
                if impl == "evoattn":          # compiled: the calls before replays began
                    row.setdefault("calls", {})[mode] = pkg.stats()
            sync()
            def one(impl: str) -> tuple[float | None, float]:
                model.set_attn_implementation(impl)
                return bench_ms(step_of[impl], device), loop_ms(step_of[impl], a.loop)
            samples = interleaved_samples({i: i for i in IMPLS}, one, a.rounds)
            t = {"do_bench": {i: [b for b, _ in s if b is not None] for i, s in samples.items()},
                 "loop": {i: [loop for _, loop in s] for i, s in samples.items()}}
            row[mode] = {h: ratio_summary(v) for h, v in t.items() if v["sdpa"]}
            row[mode]["max_abs_logits"] = (logits["sdpa"] - logits["evoattn"]).abs().max().item()
            for h, r in row[mode].items():
                if isinstance(r, dict):
                    r["tokens_per_s"] = {i: a.batch / (r[f"{i}_ms"] / 1e3) for i in IMPLS}
    del model, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_args(ap)
    ap.add_argument("--at", type=int, default=64, help="the step's new token: prompt + at")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loop", type=int, default=20, help="steps per plain-loop measurement")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--no-eager", dest="eager", action="store_false")
    a = ap.parse_args(argv)
    pkg, device = decode_package(a)
    if a.tiny:
        a.at = min(a.at, 4)
    if not 0 <= a.at < a.new:
        raise SystemExit(f"--at {a.at}: must lie in [0, --new {a.new})")
    importlib.import_module(f"{pkg.__name__}.hf").register("evoattn")
    config, model = build_model(a, device)
    rows = []
    for dtype in a.dtypes.split(","):
        row = run_dtype(pkg, model, dtype, a, device)
        rows.append(row)
        for mode in ("eager", "compiled"):
            for harness, r in row.get(mode, {}).items():
                if not isinstance(r, dict):
                    continue
                print(f"{dtype} {mode:8} {harness:8}: step SDPA {r['sdpa_ms']:.3f} ms, evoattn "
                      f"{r['evoattn_ms']:.3f} ms: {r['speedup']:.3f}x (rounds "
                      f"{r['speedup_range'][0]:.3f}-{r['speedup_range'][1]:.3f}); tokens/s "
                      f"{r['tokens_per_s']['sdpa']:.0f} vs {r['tokens_per_s']['evoattn']:.0f}",
                      flush=True)
            if mode in row:
                print(f"{dtype} {mode:8} largest logit difference SDPA vs evoattn "
                      f"{row[mode]['max_abs_logits']:.3g}", flush=True)
        for mode, calls in row.get("calls", {}).items():
            print(f"{dtype} {mode} evoattn steps' attention calls (4 steps; compiled: the "
                  f"Python-run ones before the CUDA graph replays): {calls}", flush=True)
            if device.type == "cuda" and not calls["kernel"]:
                print(f"WARNING: {dtype} {mode}: no evoattn step reached the kernel, so this "
                      "mode's evoattn figures are not the kernel's", file=sys.stderr, flush=True)
    result = {"package": pkg.__name__, "device": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "config": config.to_dict(), "rows": rows}
    Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
