"""Honest kernels evaluated while another process keeps the same GPU busy: no verdict against them.

    python -m benchmarks.contention --out contention.json [--seconds-per-eval 120]

A background process runs bf16 matmuls back to back on the GPU for the whole benchmark (a
colleague's job, another Dask worker). Each honest fixture is then evaluated with
`evoattn eval` in every timing mode on a few configs; its verdict must be a pass or an
evaluator condition (evaluator_fault naming a busy GPU), never an integrity verdict such as
hidden_work. Prints one line per evaluation and writes them as JSON. GPU only.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT

HONEST = [("tests/adversarial/honest_torch.py", ["--policy", "allow-library"]),
          ("tests/adversarial/honest_triton.py", []),
          ("seeds/sdpa/flash_hybrid.py", [])]
CONFIGS = "1,8,512,64;4,32,1024,64,nc;4,16,4096,128,causal"
LOAD = """
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + {seconds}
while time.time() < end:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--seconds-per-eval", type=float, default=120)
    args = ap.parse_args()
    runs = [(f, extra, mode) for f, extra in HONEST for mode in ("call", "kernel", "graph")]
    load = subprocess.Popen([sys.executable, "-c",
                             LOAD.format(seconds=len(runs) * args.seconds_per_eval)])
    rows = []
    try:
        for path, extra, mode in runs:
            with tempfile.TemporaryDirectory() as d:
                out = Path(d) / "r.json"
                subprocess.run([sys.executable, "-m", "evoattn.cli", "eval", path, "--configs",
                                CONFIGS, "--timing", mode, "--json", str(out), *extra],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               timeout=args.seconds_per_eval * 2)
                r = json.loads(out.read_text()) if out.is_file() else {"verdict": "no result",
                                                                        "reason": ""}
            integrity = r["verdict"] not in ("pass", "evaluator_fault", "no result")
            rows.append({"file": path, "mode": mode, "verdict": r["verdict"],
                         "reason": r.get("reason", "")[:300], "fitness": r.get("fitness"),
                         "verdict_against_honest": integrity})
            print(f"{path:40} {mode:6} {r['verdict']:16} {r.get('fitness') or 0:.3f} "
                  f"{r.get('reason', '')[:120]}", flush=True)
    finally:
        load.kill()
        load.wait()
    bad = sum(r["verdict_against_honest"] for r in rows)
    print(f"verdicts against honest kernels under contention: {bad} of {len(rows)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "verdicts_against_honest": bad},
                                             indent=1))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
