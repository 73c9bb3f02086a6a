#!/usr/bin/env python3
"""Knob settings of seeds/sdpa/wgmma_flash.cu side by side against SDPA (GPU only; Hopper).

    python benchmarks/wgmma_variants.py --variant seed: --variant old:OVERLAP_D128=0,TMA_STORE_MAX_S=1024
    python benchmarks/wgmma_variants.py --variant new: --variant prev:@/tmp/old.cu --head-dim 128 \\
        --dtype bfloat16 --do-bench 3 --json out.json

Each --variant is NAME:SETTINGS, SETTINGS a comma-separated list of KNOB=VALUE (checked as
`evoattn eval --set` checks them; empty: the seed's own values) or @FILE, another version of the
seed (for instance `git show REV:seeds/sdpa/wgmma_flash.cu > /tmp/old.cu`), optionally followed
by knob settings for it. For trusted files only: every variant is built as the evaluator builds
a fast-form CUDA file, then
  check  each variant on the 14 default sdpa configs and odd shapes (S = 1, 77, 700, 1000, 1100,
         1300, 4099; more work items than SMs), causal and not, against the float32
         reference with the evaluator's rule (error <= 2 x SDPA's own + 1e-5); a failure is
         printed, and the variant is still timed (a timing experiment may be wrong on purpose)
  time   per default config, SDPA (cuDNN on Hopper), with --triton the hybrid seed's Triton
         kernel (seeds/sdpa/flash_triton.py, D=64) and every variant, in interleaved rounds in
         a shuffled order: CUDA-graph replay of n back-to-back calls (the GPU time) and the
         same n calls eager (launches included), medians; with --do-bench N also N rounds of
         triton.testing.do_bench (L2 flushed by a write before every call)
Prints a line per config (speedup over SDPA and TFLOP/s per function, graph time) and the
geometric means per mode over all, D=64 and D=128 configs. Exits 0 when every check passes, 1
when one fails, 2 when it cannot run (no CUDA GPU, a bad --variant, a build that fails).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import math
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evaluator import runtime  # noqa: E402
from evaluator.loader import companion_headers  # noqa: E402
from evoattn.mutators.knobs import parse_settings, set_knobs  # noqa: E402

SEED = ROOT / "seeds" / "sdpa" / "wgmma_flash.cu"
CONFIGS = [(8, 32, 512, 64), (4, 32, 1024, 64), (2, 32, 2048, 64), (1, 32, 4096, 64),
           (1, 8, 512, 64), (4, 16, 4096, 128), (16, 16, 1024, 128)]
ODD = [(1, 1, 1, 128), (1, 3, 77, 128), (2, 2, 1000, 64), (1, 2, 1300, 128), (2, 3, 1100, 128),
       (4, 16, 1000, 128), (4, 24, 700, 64), (1, 4, 4099, 128), (1, 4, 4099, 64)]
DTYPE_CODES = {"float16": 0, "bfloat16": 1}   # the seed entry point's dtype argument
TARGET_MS = 3.0                               # GPU time per timed batch of calls

Attention = Callable  # (q, k, v, causal) -> out


@dataclass(frozen=True)
class Variant:
    name: str
    source: Path                              # the .cu file
    settings: tuple[str, ...]                 # KNOB=VALUE


def parse_variant(text: str) -> Variant:
    """'NAME:[@FILE][,]KNOB=V,...' -> Variant; ValueError with one line otherwise."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"--variant {text!r}: expected NAME:SETTINGS (SETTINGS may be empty)")
    parts = [p.strip() for p in rest.split(",") if p.strip()]
    source = SEED
    if parts and parts[0].startswith("@"):
        source = Path(parts.pop(0)[1:])
        if not source.is_file():
            raise ValueError(f"--variant {text!r}: {source} is not a file")
    bad = [p for p in parts if "=" not in p]
    if bad:
        raise ValueError(f"--variant {text!r}: {bad[0]!r} is not KNOB=VALUE")
    return Variant(name.strip(), source, tuple(parts))


def build(variant: Variant, tmp: Path):
    """The variant's entry point (evoattn_sdpa), built in the fast form; RuntimeError on failure."""
    source = variant.source.read_text()
    values = parse_settings(str(variant.source), source, list(variant.settings))
    work = tmp / variant.name
    work.mkdir()
    src = work / SEED.name
    src.write_text(set_knobs(source, values))
    res = runtime.build_fast(src, tmp / "cache", runtime.detect_arch(), timeout_s=600,
                             extra_files=companion_headers(SEED, source))
    if not res.ok:
        raise RuntimeError(f"{variant.name}: build failed:\n{res.log[-3000:]}")
    return runtime.load_fast(res.path, "evoattn_sdpa")


def cuda_attention(entry, dtype_code: int) -> Attention:
    import torch

    def call(q, k, v, causal):
        B, H, S, D = q.shape
        out = torch.empty_like(q)
        rc = entry(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), B, H, S, D,
                   dtype_code, int(causal), 1.0 / math.sqrt(D),
                   torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError(f"evoattn_sdpa returned {rc}")
        return out
    return call


def triton_attention() -> Attention:
    spec = importlib.util.spec_from_file_location("wv_flash_triton",
                                                  ROOT / "seeds" / "sdpa" / "flash_triton.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return lambda q, k, v, causal: mod.attention(q, k, v, causal, 1.0 / math.sqrt(q.shape[-1]))


def sdpa(q, k, v, causal):  # noqa: ANN001, ANN201
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def check(fn: Attention, shape, causal: bool, dtype) -> tuple[float, float, bool]:
    """(error, SDPA's error, within the evaluator's rule) against float32, seeded per shape."""
    import torch
    import torch.nn.functional as F
    g = torch.Generator(device="cuda").manual_seed(hash((shape, causal)) % 2**31)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    own = (sdpa(q, k, v, causal).float() - ref).abs().max().item()
    err = (fn(q, k, v, causal).float() - ref).abs().max().item()
    return err, own, math.isfinite(err) and err <= 2 * own + 1e-5


def time_config(fns: dict[str, Attention], shape, causal: bool, dtype, rounds: int,
                do_bench_rounds: int) -> dict[str, dict[str, float]]:
    """Median ms per call of each function in graph and eager mode (and do_bench)."""
    import torch
    q, k, v = (torch.randn(*shape, device="cuda", dtype=dtype) for _ in range(3))
    event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    graphs, samples = {}, {}
    for name, fn in fns.items():
        fn(q, k, v, causal)
        a, b = event(), event()
        a.record(); fn(q, k, v, causal); b.record(); torch.cuda.synchronize()
        n = max(8, min(400, int(TARGET_MS / max(a.elapsed_time(b), 1e-3))))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(q, k, v, causal)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                fn(q, k, v, causal)
        graphs[name] = (graph, n)
        samples[name] = {"graph": [], "eager": [], "do_bench": []}
    names = list(fns)
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            graph, n = graphs[name]
            graph.replay()
            a, b = event(), event()
            a.record(); graph.replay(); b.record(); torch.cuda.synchronize()
            samples[name]["graph"].append(a.elapsed_time(b) / n)
            a.record()
            for _ in range(n):
                fns[name](q, k, v, causal)
            b.record(); torch.cuda.synchronize()
            samples[name]["eager"].append(a.elapsed_time(b) / n)
    if do_bench_rounds:
        import triton.testing
        for _ in range(do_bench_rounds):
            random.shuffle(names)
            for name in names:
                fn = fns[name]
                samples[name]["do_bench"].append(
                    triton.testing.do_bench(lambda: fn(q, k, v, causal), warmup=25, rep=100))
    return {name: {mode: statistics.median(x) for mode, x in modes.items() if x}
            for name, modes in samples.items()}


def geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, metavar="NAME:SETTINGS")
    ap.add_argument("--dtype", choices=sorted(DTYPE_CODES), default="float16")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--do-bench", type=int, default=0, metavar="N", help="do_bench rounds")
    ap.add_argument("--head-dim", type=int, choices=(64, 128), help="only these configs")
    ap.add_argument("--triton", action="store_true", help="also time the Triton seed (D=64)")
    ap.add_argument("--json", type=Path, help="write every median here")
    args = ap.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variant]
        for v in variants:
            parse_settings(str(v.source), v.source.read_text(), list(v.settings))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len({v.name for v in variants}) != len(variants):
        print("error: --variant names must differ", file=sys.stderr)
        return 2
    import torch
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (Hopper for the wgmma kernels)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    tmp = Path(tempfile.mkdtemp(prefix="wgmma_variants_"))
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            entries = dict(zip((v.name for v in variants),
                               pool.map(lambda v: build(v, tmp), variants)))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fns = {name: cuda_attention(e, DTYPE_CODES[args.dtype]) for name, e in entries.items()}
    wanted = lambda shape: args.head_dim in (None, shape[3])  # noqa: E731
    failed = 0
    for name, fn in fns.items():
        for shape in filter(wanted, CONFIGS + ODD):
            for causal in (False, True):
                err, own, ok = check(fn, shape, causal, dtype)
                if not ok:
                    failed += 1
                    print(f"FAIL  {name} {shape}{' causal' if causal else ''}: error {err:.2e} "
                          f"> 2 x SDPA's {own:.2e} + 1e-5", flush=True)
    print(f"checks: {failed} failed", flush=True)
    rows = []
    triton_fn = triton_attention() if args.triton else None
    for shape in filter(wanted, CONFIGS):
        for causal in (False, True):
            timed = {"sdpa": sdpa}
            if triton_fn is not None and shape[3] == 64:
                timed["triton"] = triton_fn
            timed.update(fns)
            ms = time_config(timed, shape, causal, dtype, args.rounds, args.do_bench)
            B, H, S, D = shape
            flops = 4 * B * H * S * S * D / (2 if causal else 1)
            rows.append({"config": list(shape), "causal": causal, "ms": ms})
            base = ms["sdpa"]["graph"]
            cells = " ".join(f"{n} {base / t['graph']:.3f}x ({flops / t['graph'] / 1e9:.0f})"
                             for n, t in ms.items() if n != "sdpa")
            print(f"{str(shape):20s}{' causal' if causal else '       '} sdpa {base * 1e3:8.1f} us "
                  f"({flops / base / 1e9:.0f} TFLOP/s)  {cells}", flush=True)
    names = [n for n in ["triton", *fns] if any(n in r["ms"] for r in rows)]
    for mode in ("graph", "eager") + (("do_bench",) if args.do_bench else ()):
        for label, keep in (("all", lambda r: True), ("D=64", lambda r: r["config"][3] == 64),
                            ("D=128", lambda r: r["config"][3] == 128)):
            cells = []
            for n in names:
                ratios = [r["ms"]["sdpa"][mode] / r["ms"][n][mode] for r in rows
                          if keep(r) and n in r["ms"]]
                if ratios:
                    cells.append(f"{n} {geomean(ratios):.4f}x")
            if cells:
                print(f"geomean vs sdpa, {mode}, {label}: " + "  ".join(cells))
    if args.json:
        args.json.write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype,
            "variants": {v.name: {"source": str(v.source), "settings": list(v.settings)}
                         for v in variants},
            "failed_checks": failed, "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
