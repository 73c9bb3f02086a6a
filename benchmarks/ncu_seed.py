#!/usr/bin/env python3
"""Runs one fast-form CUDA seed on one sdpa config, for Nsight Compute (trusted seeds only).

    ncu --kernel-name regex:wgmma_ws --launch-skip 1 --launch-count 1 --section SpeedOfLight \\
        python -m benchmarks.ncu_seed seeds/sdpa/wgmma_flash.cu --config 4,16,4096,128 \\
        [--set KNOB=VALUE ...] [--causal] [--calls 2]

Builds the seed with the knob values given (checked as `evoattn eval --set` checks them)
through evoattn.contract.runtime, calls its entry point `--calls` times on random float16 inputs, and
checks the last output against torch's SDPA, so a profile of a wrong kernel says so. Prints
one line; exits 0 when the output matches, 1 when it does not or the call fails, 2 on bad
arguments. benchmarks/ncu_waits.py reads a source-page export of such a profile.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import shutil
import sys
import tempfile
from pathlib import Path

from evoattn.contract import runtime
from evoattn.child.loader import companion_headers
from evoattn.mutators.knobs import parse_settings, set_knobs

MAX_ABS_ERR = 1e-2           # float16 attention against SDPA; a wrong kernel is off by far more


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("seed", type=Path)
    ap.add_argument("--config", default="4,16,4096,128", help="B,H,S,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KNOB=VALUE")
    ap.add_argument("--calls", type=int, default=2)
    return ap.parse_args(argv)


def parse_config(text: str) -> tuple[int, int, int, int]:
    """'B,H,S,D' -> four positive ints; ValueError with one line otherwise."""
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--config {text!r}: expected four positive integers B,H,S,D")
    B, H, S, D = (int(p) for p in parts)
    return B, H, S, D


def build_seed(seed: Path, source: str, tmp: Path):
    """Builds the (knob-set) source; returns the entry point, or raises RuntimeError."""
    src = tmp / seed.name
    src.write_text(source)
    headers = companion_headers(seed, source)
    res = runtime.build_fast(src, tmp / "cache", runtime.detect_arch(), timeout_s=600,
                           extra_files=headers)
    if not res.ok:
        raise RuntimeError(f"{seed}: build failed:\n{res.log}")
    try:
        return runtime.load_fast(res.path, "evoattn_sdpa")
    except runtime.LoadError as e:
        raise RuntimeError(str(e)) from None


def run_and_check(fn, shape: tuple[int, int, int, int], causal: bool, calls: int) -> float:
    """Calls the entry point `calls` times; returns the last output's max abs error against
    SDPA, or raises RuntimeError when a call returns an error code."""
    import torch
    import torch.nn.functional as F
    B, H, S, D = shape
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    out = torch.empty_like(q)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    for _ in range(calls):
        rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), B, H, S, D, 0,
                int(causal), 1.0 / math.sqrt(D), stream)
        if rc != 0:
            raise RuntimeError(f"evoattn_sdpa returned {rc}")
    torch.cuda.synchronize()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return (out.float() - ref.float()).abs().max().item()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        source = args.seed.read_text()
        values = parse_settings(str(args.seed), source, args.sets)
        shape = parse_config(args.config)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="ncu_seed_"))
    try:
        fn = build_seed(args.seed, set_knobs(source, values), tmp)
        err = run_and_check(fn, shape, args.causal, args.calls)
    except RuntimeError as e:
        print(f"FAIL  {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ok = err < MAX_ABS_ERR
    print(f"{'PASS' if ok else 'FAIL'}  {args.seed} {values or ''} {shape}"
          f"{' causal' if args.causal else ''}: max abs err against SDPA {err:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
