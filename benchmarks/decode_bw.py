"""Decode attention against the memory-bandwidth limit: the seed and every baseline, per config.

    python -m benchmarks.decode_bw --out decode_bw.json                 # every default config
    python -m benchmarks.decode_bw --out b.json --dtype bfloat16 --configs 0,5,10
    python -m benchmarks.decode_bw --out cpu.json --device cpu          # the CPU configs, a check
    python -m benchmarks.decode_bw --out r.json --rival OTHER.py --no-baselines  # two seeds

A decode call must read the valid cache once: bytes = 2 * sum(cache_seqlens) * Hkv * D *
element size, plus q and the output (the problem's `bytes_moved`). Per config and function:
  check      two calls' outputs against the float32 reference, within the evaluator's tolerance
             (2x the error of a flash kernel's rounding, plus 1e-5); a function that fails
             is reported and not timed
  do_bench   triton.testing.do_bench (L2 flushed before every call; median), the GPU time.
             Its flush writes zeros over 256 MB, so every timed call starts with L2 full of
             dirty lines and pays their write-back (~7 µs on an H200): a decode step, whose
             previous kernels mostly read weights, does not
  clean      the GPU time by CUDA events, each call after a flush that reads 512 MB (L2 left
             holding clean lines of another buffer): the kernel time with nothing to write back
  stream     (one row per config) a plain streaming read of the same bytes (torch.sum of a
             contiguous float16 buffer, float32 accumulation) timed as `clean`: what a
             kernel that only reads gets at this size, the reference for the fraction of HBM
  eager      back-to-back calls bracketed by synchronisations, by the host clock, each call on
             its own copy of q, k, v (copies together >= 256 MB, so L2 holds none): what an
             eager decode loop pays, launch overhead included
  graph      the eager loop's calls captured in one CUDA graph and replayed (a static cache
             under CUDA graphs: no launch overhead); the capture error when a call cannot be
  host       the host time of one call while the GPU is held busy (GPU only): what a call
             costs the CPU, which an eager decode step pays when its kernels are short
  GB/s       bytes / time, and its fraction of the GPU's datasheet HBM bandwidth (H100 SXM
             3.35 TB/s, H200 4.8 TB/s; --peak-tbps overrides)
Then the seed's speedup over SDPA-as-transformers-calls-it (`sdpa_hf`) and over FlexAttention
(`flex`) per config and as geometric means. Baselines that cannot run (flash-attn absent) are
named with the reason. With --rival, a second candidate file is timed beside the seed (the
same inputs, one process) and the seed's speedup over it reported as over a baseline. The JSON
holds every number.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import ROOT, eager_ms, geomean, host_us, load_module, sync
from evoattn.child import device as devinfo
from evoattn.problems import get_problem
from evoattn.problems.decode import lengths

EAGER_SET_BYTES = 256 * 2 ** 20      # the eager loop's input copies fill at least this ...
EAGER_MAX_COPIES = 16                # ... with at most this many copies
RANDOM = ("q", "k", "v")
COMPARED = ("sdpa_hf", "flex", "flash_kvcache", "rival")   # the seed's speedup over each
MODES = ("do_bench", "clean", "eager", "graph")


def load_seed(path: Path, module_name: str = "decode_candidate") -> Any:
    """Imports a decode candidate file by path; returns its `attention`."""
    return load_module(path, module_name).attention


def copies_of(inputs: dict[str, Any], n: int, problem: Any, gen: Any) -> list[dict[str, Any]]:
    """Returns n input sets with their own q, k, v (fresh values, garbage tails), the rest
    shared."""
    out = []
    for _ in range(n):
        s = {k: (v.clone() if k in RANDOM else v) for k, v in inputs.items()}
        problem.refill(s, gen)
        out.append(s)
    return out


def graph_us(fn: Callable[[dict[str, Any]], Any], sets: list[dict[str, Any]],
             rounds: int) -> tuple[float | None, str]:
    """Returns (µs per call of the calls replayed from one CUDA graph, or None; why not)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for s in sets:                              # warm up on the side stream
                fn(s)
        torch.cuda.current_stream().wait_stream(stream)
        sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for s in sets:
                fn(s)
        sync()
    except Exception as e:  # noqa: BLE001 - a function that cannot be captured: reported
        sync()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for r in range(rounds + 1):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if r:
            times.append(start.elapsed_time(end) * 1e3 / len(sets))
    del graph
    return statistics.median(times), ""


def do_bench_us(fn: Callable[[], Any], on_gpu: bool, rep_ms: int) -> float:
    """Returns triton.testing.do_bench's median in µs (the host clock on the CPU)."""
    if not on_gpu:
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3 * 1e6
    import triton
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")) * 1e3


class CleanFlush:
    """Clean-L2 event timing (the `clean` mode): a read of FLUSH_BYTES before every call."""

    FLUSH_BYTES = 512 * 2 ** 20

    def __init__(self) -> None:
        self.buf = torch.ones(self.FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
        self.sink = torch.empty((), dtype=torch.float32, device="cuda")

    def flush(self) -> None:
        torch.sum(self.buf, dim=0, out=self.sink)

    def us(self, fn: Callable[[], Any], reps: int = 100) -> float:
        """Returns the median GPU time in µs of fn over reps calls, each after a flush."""
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for _ in range(5):
            self.flush()
            fn()
        sync()
        for start, end in zip(starts, ends):
            self.flush()
            start.record()
            fn()
            end.record()
        sync()
        return statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends)) * 1e3

    def stream_us(self, nbytes: float) -> float:
        """Returns the `clean` time of a plain read of nbytes (the `stream` reference)."""
        data = torch.ones(int(nbytes) // 2, dtype=torch.float16, device="cuda")
        sink = torch.empty((), dtype=torch.float32, device="cuda")
        us = self.us(lambda: torch.sum(data, dim=0, dtype=torch.float32, out=sink))
        del data
        return us


def bench_config(problem: Any, cfg: dict[str, Any], fns: dict[str, Callable[..., Any]],
                 dtype: Any, device: Any, args: argparse.Namespace, peak_tbps: float | None,
                 clean: CleanFlush | None = None) -> dict[str, Any]:
    """Checks, then times, every function on one config; returns its row."""
    on_gpu = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(1234)
    inputs = problem.make_inputs(cfg, dtype, device, gen)
    nbytes = problem.bytes_moved(cfg, inputs["q"].element_size())
    ref = problem.reference(inputs, cfg)
    torch_err = (problem.torch_in_dtype(inputs, cfg).float() - ref).abs().max().item()
    bound = problem.tolerance.bound(torch_err)
    set_bytes = sum(inputs[n].numel() * inputs[n].element_size() for n in RANDOM)
    n_sets = max(2, min(EAGER_MAX_COPIES, math.ceil(EAGER_SET_BYTES / set_bytes)))
    sets = copies_of(inputs, n_sets, problem, gen) if on_gpu else [inputs]
    row: dict[str, Any] = {"cfg": cfg, "label": problem.label(cfg), "bytes": nbytes,
                           "flops": problem.flops(cfg), "sum_lengths": sum(lengths(cfg)),
                           "torch_err": torch_err, "bound": bound, "eager_sets": len(sets),
                           "results": {}}
    if clean is not None:
        row["stream_us"] = clean.stream_us(nbytes)
        row["stream_gbps"] = nbytes / (row["stream_us"] * 1e-6) / 1e9
        if peak_tbps:
            row["stream_frac_hbm"] = row["stream_gbps"] / (peak_tbps * 1e3)
    for name, fn in fns.items():
        res: dict[str, Any] = {}
        row["results"][name] = res
        try:        # twice: a second call may take another path (a prepared launch)
            err = 0.0
            for _ in range(2):
                out = fn(inputs, cfg)
                sync()
                err = max(err, (out.float() - ref).abs().max().item())
        except Exception as e:  # noqa: BLE001 - reported, not timed
            res.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            continue
        res.update(err=err, ok=bool(err <= bound))
        if not res["ok"]:
            continue
        bound_fn = (lambda f: lambda s: f(s, cfg))(fn)
        res["do_bench_us"] = do_bench_us(lambda: bound_fn(inputs), on_gpu, args.rep_ms)
        if clean is not None:
            res["clean_us"] = clean.us(lambda: bound_fn(inputs))
        res["eager_us"] = eager_ms(bound_fn, sets, args.rounds) * 1e3
        if on_gpu:
            res["host_us"] = host_us(lambda: bound_fn(inputs))
        if on_gpu and not args.no_graph:
            res["graph_us"], why = graph_us(bound_fn, sets, args.rounds)
            if why:
                res["graph_error"] = why
        for mode in MODES:
            us = res.get(f"{mode}_us")
            if us:
                res[f"{mode}_gbps"] = nbytes / (us * 1e-6) / 1e9
                if peak_tbps:
                    res[f"{mode}_frac_hbm"] = res[f"{mode}_gbps"] / (peak_tbps * 1e3)
    seed = row["results"].get("seed", {})
    for base in COMPARED:
        b = row["results"].get(base, {})
        for mode in MODES:
            if seed.get(f"{mode}_us") and b.get(f"{mode}_us"):
                row[f"speedup_vs_{base}_{mode}"] = b[f"{mode}_us"] / seed[f"{mode}_us"]
    del inputs, sets, ref
    if on_gpu:
        torch.cuda.empty_cache()
    return row


def print_row(row: dict[str, Any]) -> None:
    print(f"\n{row['label']}: {row['bytes'] / 1e6:.1f} MB moved at least "
          f"(sum of lengths {row['sum_lengths']}), tolerance {row['bound']:.2e}")
    if row.get("stream_us"):
        print(f"  {'stream read':14s} clean {row['stream_us']:9.1f} us "
              f"{row['stream_gbps']:7.0f} GB/s"
              + (f" ({100 * row['stream_frac_hbm']:4.1f}% HBM)" if row.get("stream_frac_hbm")
                 else "") + ": a plain read of the same bytes")
    for name, r in row["results"].items():
        if not r.get("ok"):
            why = r.get("error") or f"error {r['err']:.3g} > {row['bound']:.3g}"
            print(f"  {name:14s} NOT CORRECT: {why}")
            continue
        cells = []
        for mode in MODES:
            us = r.get(f"{mode}_us")
            if us is None:
                cells.append(f"{mode} -")
                continue
            frac = r.get(f"{mode}_frac_hbm")
            cells.append(f"{mode} {us:9.1f} us {r[f'{mode}_gbps']:7.0f} GB/s"
                         + (f" ({100 * frac:4.1f}% HBM)" if frac is not None else ""))
        if r.get("host_us") is not None:
            cells.append(f"host {r['host_us']:5.1f} us")
        print(f"  {name:14s} " + " | ".join(cells))
    ratios = [f"{k.replace('speedup_vs_', 'x ')}: {v:.2f}" for k, v in row.items()
              if k.startswith("speedup_vs_")]
    if ratios:
        print("  seed " + ", ".join(ratios))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--seed", default=str(ROOT / "seeds/decode/decode_triton.py"))
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--configs", default="", help="indices into the default configs (0,3,...)")
    ap.add_argument("--extras", action="store_true",
                    help="also time the diagnostic SDPA variants (enable_gqa with the mask)")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench's time budget per call")
    ap.add_argument("--rounds", type=int, default=10, help="eager and graph rounds")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--peak-tbps", type=float, default=None)
    ap.add_argument("--rival", default="", help="another candidate file, timed beside the seed")
    ap.add_argument("--no-baselines", action="store_true", help="time only the seed (and rival)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu for the CPU check")
    problem = get_problem("decode")
    configs = list(problem.default_configs if device.type == "cuda" else problem.cpu_configs)
    if args.configs:
        configs = [configs[int(i)] for i in args.configs.split(",")]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = args.peak_tbps or devinfo.hbm_tbps(name)
    attention = load_seed(Path(args.seed))
    fns: dict[str, Callable[..., Any]] = {"seed": lambda inp, c: problem.call(attention, inp, c)}
    if args.rival:
        rival = load_seed(Path(args.rival), "decode_rival")
        fns["rival"] = lambda inp, c: problem.call(rival, inp, c)
    if not args.no_baselines:
        fns.update(problem.baselines())
    if args.extras:
        fns["sdpa_gqa_mask"] = problem.extra_baselines()["sdpa_gqa_mask"]
    skipped = {} if args.no_baselines else problem.skipped_baselines()
    dtype = getattr(torch, args.dtype)
    print(f"{name}: HBM {peak} TB/s (datasheet); {args.dtype}; functions {', '.join(fns)}")
    for n, why in skipped.items():
        print(f"  skipped baseline {n}: {why}")
    rows = []
    clean = CleanFlush() if device.type == "cuda" else None
    for cfg in configs:
        row = bench_config(problem, cfg, fns, dtype, device, args, peak, clean)
        print_row(row)
        rows.append(row)
    summary: dict[str, Any] = {}
    for base in COMPARED:
        for mode in MODES:
            vals = [r.get(f"speedup_vs_{base}_{mode}") for r in rows]
            if any(vals):
                summary[f"geomean_speedup_vs_{base}_{mode}"] = geomean([v for v in vals if v])
                summary[f"configs_vs_{base}_{mode}"] = sum(1 for v in vals if v)
    print("\n" + "\n".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}"
                           for k, v in summary.items()))
    Path(args.out).write_text(json.dumps({
        "device": name, "hbm_tbps": peak, "dtype": args.dtype, "seed": args.seed,
        "rival": args.rival or None, "versions": devinfo.versions(),
        "skipped_baselines": skipped, "rows": rows, "summary": summary}, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
