"""Greedy generation through an exported `decode` kernel against SDPA: same tokens, tokens/s.

    python -m benchmarks.decode_generate --export RUN_DIR/best --out gen.json
    python -m benchmarks.decode_generate --export RUN_DIR/best --dtypes bfloat16 --out g.json
    python -m benchmarks.decode_generate --export RUN_DIR/best --cache static --out gs.json
    python -m benchmarks.decode_generate --export RUN_DIR/best --prefill-export SDPA_RUN/best \
        --out g.json          # the prompt through an exported prefill kernel as well
    python -m benchmarks.decode_generate --export RUN_DIR/best --device cpu --tiny --out g.json

A Llama-shaped model with random weights, no download (hidden 2048, 16 layers, MLP 8192, 32
query heads of 64 and 8 key/value heads: GQA 4:1, vocabulary 32000), --batch prompts of
--prompt random tokens (no padding), --new tokens generated greedily (min_new_tokens =
max_new_tokens: every run takes the same steps), per dtype, over --cache:
  dynamic    transformers' default cache, grown by one token a step (eager)
  static     a cache allocated for the whole generation, its steps compiled as generate
             compiles them on a GPU (torch.compile, CUDA graphs; --eager: not compiled); SDPA
             gets a mask over the whole cache, the kernel the cache's lengths
and:
  tokens     the evoattn generation's tokens equal SDPA's (else the first new token that
             differs, counting from 0: new token 0 comes from the prompt's forward)
  time       after a warm-up of each (which compiles), --runs rounds of, per implementation,
             the prefill alone (max_new_tokens=1) and the whole generation, the order of the
             two implementations reversed every round; a round's decode steps take the
             difference; tokens/s = batch * (new - 1) / the median of those; the speedup is
             the median of the rounds' ratios, printed with their range
  attention  the share of the decode steps spent in attention: CUDA events around every
             one-token attention call of one more generation, summed, over its decode time
             (the events cost a little: this run is not the timed one; not taken for
             compiled steps, whose attention calls run inside CUDA graphs)
  forced     teacher-forced agreement (eager, a dynamic cache): a float32 copy of the model
             on SDPA and each implementation take SDPA's greedy tokens, and every decode step's
             logits are compared with the float32 ones (largest abs difference, top-1
             agreement); the kernel agrees when it is as close as SDPA (hf_model's rule)
  ties       random weights make near ties, where identical tokens are a matter of rounding:
             the median float32 top-2 logit gap over the decode steps; where the kernel's
             tokens first part from SDPA's, the float32 model's logit of SDPA's token less the
             kernel's (the gap); and the same for SDPA on PyTorch's math backend (another
             exact order of the same sums; eager rows only)
  calls      the package's kernel and fallback counts over the rounds' evoattn runs (the prefill
             falls back: a decode kernel serves the one-token steps; replays of compiled steps
             run no Python and are not counted); with --prefill-export, the prefill package's
             counts too (the prompt's calls)
--tiny: 2 layers, hidden 256, 4/2 heads of 64, a 32-token prompt, 8 new tokens (the CPU check).
"""
from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import interleaved_samples, sync
from benchmarks.hf_model import Clock, attention_time, judge, load_export


def model_config(a: argparse.Namespace) -> Any:
    from transformers import LlamaConfig
    if a.tiny:
        return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=97)
    return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                       max_position_embeddings=a.prompt + a.new + 16)


def cache_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """generate's keyword arguments for --cache and --eager."""
    if a.cache == "dynamic":
        return {}
    return {"cache_implementation": "static", "disable_compile": a.eager}


def timed_generate(model: Any, ids: torch.Tensor, new: int, device: torch.device,
                   **kwargs: Any) -> tuple[Any, float]:
    """Returns (tokens, seconds) of one greedy generation of exactly `new` tokens."""
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)
    sync()
    return out, time.perf_counter() - t0


IMPLS = ("sdpa", "evoattn")
SDPA_MATH = "sdpa_math"
STEP_TOKENS = 16               # the most new tokens of a decode call (the decode problem's Sq)


def register_sdpa_math() -> None:
    """Registers SDPA_MATH with transformers: SDPA as transformers calls it, with SDPA's masks,
    but every call of up to STEP_TOKENS new tokens (the decode steps) on PyTorch's math
    backend; the prompt as SDPA takes it (the math backend would hold its whole score
    matrix)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def forward(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if query.shape[2] > STEP_TOKENS:
            return sdpa_attention_forward(module, query, *args, **kwargs)
        with sdpa_kernel(SDPBackend.MATH):
            return sdpa_attention_forward(module, query, *args, **kwargs)

    AttentionInterface.register(SDPA_MATH, forward)
    AttentionMaskInterface.register(SDPA_MATH, sdpa_mask)


def timed_rounds(model: Any, ids: torch.Tensor, a: argparse.Namespace, device: torch.device,
                 kw: dict[str, Any], pkgs: list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each implementation's warm-up generation first (it compiles), then --runs rounds: per
    round and implementation the prefill alone (max_new_tokens=1) and the whole generation,
    the order of the implementations reversed every round, so that a drift in the host's or
    the GPU's speed falls on both alike. Returns ({impl: {"prefill_s": [...], "total_s":
    [...]}}, {impl: the first round's tokens}); the packages' counts start after the warm-ups."""
    for impl in IMPLS:
        model.set_attn_implementation(impl)
        timed_generate(model, ids, a.new, device, **kw)
    for p in pkgs:
        p.reset_stats()
    tokens: dict[str, Any] = {}

    def one(impl: str) -> tuple[float, float]:
        model.set_attn_implementation(impl)
        prefill = timed_generate(model, ids, 1, device, **kw)[1]
        out, total = timed_generate(model, ids, a.new, device, **kw)
        tokens.setdefault(impl, out)
        return prefill, total
    samples = interleaved_samples({impl: impl for impl in IMPLS}, one, a.runs)
    times = {impl: {"prefill_s": [p for p, _ in s], "total_s": [t for _, t in s]}
             for impl, s in samples.items()}
    return times, tokens


def summarise(times: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """Per implementation: medians, the decode steps' seconds per round (the whole generation
    less that round's prefill) and tokens/s; the speedup as the median of the rounds' ratios
    with their range (each round times both implementations back to back)."""
    out: dict[str, Any] = {}
    for impl, t in times.items():
        decode = [tot - pre for pre, tot in zip(t["prefill_s"], t["total_s"])]
        d = statistics.median(decode)     # <= 0: the steps were lost in the prefill's noise
        out[impl] = {"prefill_s_runs": t["prefill_s"], "total_s_runs": t["total_s"],
                     "decode_s_runs": decode, "prefill_s": statistics.median(t["prefill_s"]),
                     "total_s": statistics.median(t["total_s"]), "decode_s": d,
                     "tokens_per_s": a.batch * (a.new - 1) / d if d > 0 else None}
    ratios = [s / e for s, e in zip(out["sdpa"]["decode_s_runs"], out["evoattn"]["decode_s_runs"])
              if s > 0 and e > 0]
    out["speedup_tokens_per_s"] = statistics.median(ratios) if ratios else None
    out["speedup_range"] = [min(ratios), max(ratios)] if ratios else None
    return out


PREFILL_CHUNK = 1024           # prompt tokens per forward of the teacher-forced check


def cache_keyword(model: Any) -> str:
    """The name forward takes the KV cache by: transformers renames past_key_values to cache
    (5.24 warns, 5.40 drops the old name)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"


def forced_steps(model: Any, ids: torch.Tensor, forced: torch.Tensor,
                 each: Any) -> None:
    """The prompt's forwards (PREFILL_CHUNK tokens each), then one-token forwards over a
    dynamic cache feeding `forced` (B, n) new tokens instead of the model's own: each(k,
    logits (B, V) float32) gets the logits that predict forced[:, k], for k < n (k = 0: the
    prompt's last forward; every later one a decode step)."""
    name = cache_keyword(model)
    # The prompt in chunks: in float32 SDPA has no fused kernel for GQA and would materialise
    # the whole (B, H, S, S) score matrix (128 GiB at batch 16 and an 8k prompt).
    out = None
    for i in range(0, ids.shape[1], PREFILL_CHUNK):
        out = model(ids[:, i:i + PREFILL_CHUNK], use_cache=True, logits_to_keep=1,
                    **({} if out is None else {name: out.past_key_values}))
    each(0, out.logits[:, -1].float())
    cache = out.past_key_values
    for t in range(forced.shape[1] - 1):
        out = model(forced[:, t:t + 1], use_cache=True, **{name: cache})
        each(t + 1, out.logits[:, -1].float())


def parting(forced: torch.Tensor, other: torch.Tensor,
            refs: dict[int, torch.Tensor]) -> dict[str, Any] | None:
    """Where `other` (B, n) new tokens first part from `forced` (SDPA's): the new token k
    (from 0), the first sequence b that differs there, and `gap`, the reference's logit of
    SDPA's token there less its logit of the other's (refs[k]: the reference's logits that
    predict new token k, teacher-forced on SDPA's tokens, so on the context both saw; a gap
    near 0 is a near tie, a negative one means the reference prefers the other token). None
    where they never part."""
    n = min(forced.shape[1], other.shape[1])
    diff = forced[:, :n] != other[:, :n]
    cols = diff.any(0).nonzero()
    if not len(cols):
        return None
    k = int(cols[0])
    b = int(diff[:, k].nonzero()[0])
    r = refs[k][b]
    return {"token": k, "sequence": b,
            "gap": float(r[int(forced[b, k])] - r[int(other[b, k])])}


def forced_agreement(model: Any, ref_model: Any, ids: torch.Tensor, forced: torch.Tensor,
                     others: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Teacher-forced agreement with a float32 reference: the reference model (float32 weights,
    SDPA) and each implementation in the model's dtype take the same tokens (SDPA's greedy
    ones), and every decode step's logits are compared: largest abs difference and top-1
    agreement over all steps and sequences. This says whether the kernel's steps are as close
    to exact as SDPA's (hf_model.judge). Where random weights make near ties, identical
    greedy tokens are a matter of rounding: `median_gap` is the reference's median top-2 gap
    over the decode steps, and `parting` says, for each of `others` (name: its greedy new
    tokens), where and how near a tie it first parts from SDPA's (parting())."""
    refs: dict[int, torch.Tensor] = {}
    ref_model.set_attn_implementation("sdpa")
    forced_steps(ref_model, ids, forced, refs.__setitem__)
    got: dict[str, Any] = {"steps": len(refs) - 1}
    for impl in IMPLS:
        model.set_attn_implementation(impl)
        acc = {"max_abs": 0.0, "hits": 0, "n": 0}

        def each(k: int, logits: torch.Tensor) -> None:
            if k == 0:                       # the prompt's forward, not a decode step
                return
            acc["max_abs"] = max(acc["max_abs"], (logits - refs[k]).abs().max().item())
            acc["hits"] += int((logits.argmax(-1) == refs[k].argmax(-1)).sum())
            acc["n"] += logits.shape[0]

        forced_steps(model, ids, forced, each)
        got[impl] = {"max_abs": acc["max_abs"], "top1": acc["hits"] / max(acc["n"], 1)}
    got["agrees"] = judge(got["sdpa"], got["evoattn"])
    steps = [refs[k] for k in range(1, len(refs))]
    if steps:
        top2 = torch.stack(steps).topk(2, dim=-1).values
        got["median_gap"] = float((top2[..., 0] - top2[..., 1]).median())
    got["parting"] = {name: parting(forced, toks, refs) for name, toks in (others or {}).items()}
    return got


def run_dtype(pkg: Any, ref_model: Any, dtype: str,
              a: argparse.Namespace, device: torch.device,
              prefill_pkg: Any = None) -> dict[str, Any]:
    """Generates with both implementations in one dtype; returns the row. ref_model: the
    float32 model, the reference of the teacher-forced agreement."""
    model = copy.deepcopy(ref_model).to(getattr(torch, dtype))
    cfg = model.config
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(1, cfg.vocab_size, (a.batch, a.prompt), generator=gen).to(device)
    # generate compiles a static cache's steps on GPUs only
    row: dict[str, Any] = {"dtype": dtype, "batch": a.batch, "prompt": a.prompt, "new": a.new,
                           "cache": a.cache, "compiled": a.cache == "static" and not a.eager
                           and device.type == "cuda"}
    kw = cache_kwargs(a)
    pkgs = [p for p in (pkg, prefill_pkg) if p is not None]
    with torch.no_grad():
        times, tokens = timed_rounds(model, ids, a, device, kw, pkgs)
        row.update(summarise(times, a))
        stats = pkg.stats()                               # over the rounds' evoattn runs
        row["evoattn"]["calls"] = (stats if prefill_pkg is None
                                   else {"decode": stats, "prefill": prefill_pkg.stats()})
        if device.type == "cuda" and not row["compiled"]:
            for impl in IMPLS:               # the one-token calls of one more generation
                model.set_attn_implementation(impl)
                ms, _ = attention_time(lambda: timed_generate(model, ids, a.new, device, **kw),
                                       impl, Clock(device), only=lambda q: q.shape[2] == 1)
                d = row[impl]["decode_s"]
                row[impl]["attention_share"] = ms / 1e3 / d if d > 0 else None
        if not row["compiled"]:              # SDPA on another backend, for its tokens
            model.set_attn_implementation(SDPA_MATH)
            tokens[SDPA_MATH] = timed_generate(model, ids, a.new, device, **kw)[0]
        new = {impl: t[:, a.prompt:] for impl, t in tokens.items()}
        row["forced"] = forced_agreement(model, ref_model, ids, new["sdpa"],
                                         {impl: new[impl] for impl in new if impl != "sdpa"})
    row["same_tokens"] = bool(torch.equal(tokens["sdpa"], tokens["evoattn"]))
    row["first_difference"] = row["forced"]["parting"]["evoattn"]
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _range(row: dict[str, Any]) -> str:
    r = row["speedup_range"]
    return "n/a" if r is None else f"{r[0]:.3f}-{r[1]:.3f}x"


def _parting(p: dict[str, Any] | None) -> str:
    return "never" if p is None else f"at new token {p['token']} (float32 gap {p['gap']:.3g})"


def ties_line(f: dict[str, Any]) -> str:
    """The teacher-forced check's near ties, in words."""
    line = (f"float32 top-2 gap: median {_fmt(f.get('median_gap'), '.3g')}; "
            f"evoattn parts from SDPA {_parting(f['parting']['evoattn'])}")
    if SDPA_MATH in f["parting"]:
        line += f", SDPA's math backend {_parting(f['parting'][SDPA_MATH])}"
    return line


def model_args(ap: argparse.ArgumentParser) -> None:
    """The arguments this benchmark shares with decode_step.py: the export, the output, the
    device, the dtypes and the model's batch, prompt and new tokens (--tiny on the CPU)."""
    ap.add_argument("--export", required=True, help="an export directory or a run's best/")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--tiny", action="store_true")


def decode_package(a: argparse.Namespace) -> tuple[Any, torch.device]:
    """Checks model_args (the full model needs a GPU; --tiny shrinks it) and imports the
    export, which must be a decode kernel's. Returns (package, device)."""
    if a.device == "cpu" and not a.tiny:
        raise SystemExit("the full-size model needs a GPU: use --tiny on the CPU")
    if a.tiny:
        a.batch, a.prompt, a.new = min(a.batch, 2), min(a.prompt, 32), min(a.new, 8)
    pkg = load_export(a.export)
    if pkg.PROBLEM != "decode":
        raise SystemExit(f"{a.export}: a {pkg.PROBLEM} kernel; this benchmark needs a decode one")
    return pkg, torch.device(a.device)


def build_model(a: argparse.Namespace, device: torch.device) -> tuple[Any, Any]:
    """The float32 model of model_config(a) on the device, seeded: (config, model)."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    config = model_config(a)
    with torch.device(device):
        return config, LlamaForCausalLM(config).eval()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_args(ap)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cache", default="dynamic", choices=("dynamic", "static"))
    ap.add_argument("--prefill-export", default="",
                    help="an sdpa or gqa export whose kernel takes the prompt")
    ap.add_argument("--eager", action="store_true",
                    help="with --cache static: do not compile the steps")
    a = ap.parse_args(argv)
    pkg, device = decode_package(a)
    hf = importlib.import_module(f"{pkg.__name__}.hf")
    prefill_pkg = load_export(a.prefill_export) if a.prefill_export else None
    try:
        hf.register("evoattn", prefill=prefill_pkg)
    except ValueError as e:
        raise SystemExit(f"{a.prefill_export}: {e}") from None
    register_sdpa_math()
    config, model = build_model(a, device)
    rows = []
    for dtype in a.dtypes.split(","):
        row = run_dtype(pkg, model, dtype, a, device, prefill_pkg)
        rows.append(row)
        s, e, f = row["sdpa"], row["evoattn"], row["forced"]
        print(f"{dtype}, {a.cache} cache{' (compiled)' if row['compiled'] else ''}: "
              f"same tokens {row['same_tokens']}; tokens/s SDPA {_fmt(s['tokens_per_s'], '.0f')}, "
              f"evoattn {_fmt(e['tokens_per_s'], '.0f')} "
              f"({_fmt(row['speedup_tokens_per_s'], '.3f')}x, rounds {_range(row)}); "
              f"attention share SDPA "
              f"{_fmt(s.get('attention_share'), '.2f')}, evoattn "
              f"{_fmt(e.get('attention_share'), '.2f')}; "
              f"teacher-forced top-1 against float32 SDPA {f['sdpa']['top1']:.4f}, evoattn "
              f"{f['evoattn']['top1']:.4f} (max abs {f['sdpa']['max_abs']:.3g}, "
              f"{f['evoattn']['max_abs']:.3g}): {'agrees' if f['agrees'] else 'DISAGREES'}; "
              f"{ties_line(f)}; calls over the rounds {e['calls']}", flush=True)
    result = {"package": pkg.__name__, "device": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "cpu", "config": config.to_dict(), "rows": rows}
    Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
