#!/usr/bin/env python3
"""Runs one fast-form CUDA seed on one sdpa config, for Nsight Compute (trusted seeds only).

    ncu --kernel-name regex:wgmma_ws --launch-skip 2 --launch-count 1 --section ... \\
        python benchmarks/ncu_seed.py seeds/sdpa/wgmma_flash.cu --config 4,16,4096,128 \\
        [--set KNOB=VALUE ...] [--causal] [--calls 3]

Builds the seed (with the knob values given, as `evoattn eval --set` does) through
evaluator.build, then calls its entry point `--calls` times on random float16 inputs and checks
the last output against torch's SDPA, so a profile of a wrong kernel says so.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evaluator import build  # noqa: E402
from evoattn.mutators.knobs import find_knobs, set_knobs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("seed")
    ap.add_argument("--config", default="4,16,4096,128", help="B,H,S,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KNOB=VALUE")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    source = Path(args.seed).read_text()
    values = dict(s.split("=", 1) for s in args.sets)
    unknown = set(values) - {k.name for k in find_knobs(source)}
    if unknown:
        print(f"{args.seed}: no knob named {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="ncu_seed_"))
    src = tmp / Path(args.seed).name
    src.write_text(set_knobs(source, values))
    res = build.build_fast(src, tmp / "cache", build.detect_arch(), timeout_s=600)
    if not res.ok:
        print(res.log, file=sys.stderr)
        return 1
    fn = build.load_fast(res.path, "evoattn_sdpa")
    B, H, S, D = (int(x) for x in args.config.split(","))
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    out = torch.empty_like(q)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    scale = 1.0 / math.sqrt(D)
    for _ in range(args.calls):
        rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), B, H, S, D, 0,
                int(args.causal), scale, stream)
        if rc != 0:
            print(f"evoattn_sdpa returned {rc}", file=sys.stderr)
            return 1
    torch.cuda.synchronize()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
    err = (out.float() - ref.float()).abs().max().item()
    print(f"{args.seed} {values or ''} ({B},{H},{S},{D}){' causal' if args.causal else ''}: "
          f"max abs err against SDPA {err:.2e}")
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
