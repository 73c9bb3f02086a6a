"""Where the host time of one call goes: a seed program against SDPA, per config (GPU only).

    python -m benchmarks.host_cost [seeds/sdpa/flash_hybrid.py] [--set KNOB=VALUE ...] [--json F]

For trusted files only (the seeds): the program is loaded in this process, its CUDA companions
built as the evaluator builds them. Per default sdpa config it prints the host time of one call
while the GPU is held busy (a sleep kernel queued first, so no call waits for the GPU), for the
program and for SDPA, and the per-call time of back-to-back eager calls on distinct inputs,
each the median of 5 rounds in which program and SDPA take turns.
--breakdown (the default seed only) adds, for one Triton-routed and one CUDA-routed config, the
host time of each piece of a call: Triton's prepared launcher alone, the descriptors, the
output allocation, the stream lookup, the ctypes call, and an empty kernel launch for scale.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import eager_ms, host_us, interleaved, label, load_program


def breakdown(mod) -> dict:  # noqa: ANN001
    """Host µs of each piece of one call of the default seed, per route (see the docstring)."""
    import torch
    tri = mod._triton
    out = {}
    for name, (B, H, S, D, causal) in {"triton (1,8,512,64) causal": (1, 8, 512, 64, True),
                                       "cuda (16,16,1024,128)": (16, 16, 1024, 128, False)}.items():
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
        scale = D ** -0.5
        row = {"attention": host_us(lambda: mod.attention(q, k, v, causal)),
               "sdpa": host_us(lambda: torch.nn.functional.scaled_dot_product_attention(
                   q, k, v, is_causal=causal)),
               "torch.empty": host_us(lambda: torch.empty(q.shape, dtype=q.dtype,
                                                          device=q.device)),
               "raw stream": host_us(lambda: torch._C._cuda_getCurrentRawStream(0)),
               "empty kernel (x.zero_())": host_us(lambda: q[0, 0, 0].zero_())}
        if name.startswith("triton"):
            row["triton.attention"] = host_us(lambda: tri.attention(q, k, v, causal))
            row["_fast_ok"] = host_us(lambda: tri._fast_ok(q, k, v, q.device))
            launch = next(iter(tri._LAUNCHES.values()), None)
            if launch is not None:
                o = torch.empty_like(q)
                row["_launch_prepared"] = host_us(
                    lambda: tri._launch_prepared(launch, q, k, v, scale, q.device))
                if launch.descs is not None:
                    row["4 descriptors"] = host_us(lambda: tuple(
                        tri._Desc(t, *d) for t, d in zip((q, k, v, o), launch.descs)))
                    args = tuple(tri._Desc(t, *d) for t, d in zip((q, k, v, o), launch.descs))
                else:
                    args = (q, k, v, o)
                stream = torch._C._cuda_getCurrentRawStream(0)
                row["launch.run, args prebuilt"] = host_us(lambda: launch.run(
                    launch.grid, 1, 1, stream, launch.function, launch.packed, None, None,
                    None, *args, scale, *launch.ints, *launch.constexprs))
        else:
            call = mod._cuda_call(q, causal, scale)
            row["_cuda_call, made once"] = host_us(lambda: call(q, k, v))
            fn, o = mod._cuda_entry(), torch.empty_like(q)
            args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), B, H, S, D, 0,
                    int(causal), scale, torch._C._cuda_getCurrentRawStream(0))
            row["ctypes call, args prebuilt"] = host_us(lambda: fn(*args))
        out[name] = row
        print(name, "  ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("program", nargs="?", default="seeds/sdpa/flash_hybrid.py")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--json")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--pin-cpu", action="store_true",
                    help="time on the fastest CPU, pinned, as the evaluator does")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from evoattn.problems import get_problem
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        mod = load_program(Path(a.program), a.sets, Path(tmp), "host_cost_program")[0]
        if a.pin_cpu:                 # after the build: nvcc keeps every CPU
            from evoattn.child.cpu_pin import TimingCpu
            cpu = TimingCpu()
            print(f"pinned to CPU {cpu.pick()} (the CPUs' speeds differ {cpu.spread():.2f}x)")
        pieces = breakdown(mod) if a.breakdown else None
        for cfg in get_problem("sdpa").default_configs:
            B, H, S, D, causal = cfg["B"], cfg["H"], cfg["S"], cfg["D"], cfg["causal"]
            sets = [tuple(torch.randn(B, H, S, D, device="cuda", dtype=torch.float16)
                          for _ in range(3)) for _ in range(max(4, min(32, 2 ** 28 // (
                              3 * B * H * S * D * 2))))]
            q, k, v = sets[0]
            host = interleaved({"ours": lambda: mod.attention(q, k, v, causal),
                                "sdpa": lambda: F.scaled_dot_product_attention(
                                    q, k, v, is_causal=causal)}, host_us)
            call = interleaved({"ours": lambda s: mod.attention(*s, causal),
                                "sdpa": lambda s: F.scaled_dot_product_attention(
                                    *s, is_causal=causal)}, lambda f: eager_ms(f, sets, 3))
            row = {"cfg": cfg, "host_us": host["ours"], "sdpa_host_us": host["sdpa"],
                   "call_ms": call["ours"], "sdpa_call_ms": call["sdpa"]}
            rows.append(row)
            print(f"{label('sdpa', cfg):24}  host {row['host_us']:6.1f} us"
                  f" (SDPA {row['sdpa_host_us']:5.1f}, x{row['host_us'] / row['sdpa_host_us']:.2f})"
                  f"  call {row['call_ms']:.4f} ms (SDPA {row['sdpa_call_ms']:.4f}, "
                  f"speedup {row['sdpa_call_ms'] / row['call_ms']:.3f})", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"program": a.program, "sets": a.sets, "rows": rows, "breakdown": pieces,
                                            "device": torch.cuda.get_device_name(),
                                            "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
