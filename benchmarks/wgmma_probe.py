#!/usr/bin/env python3
"""Quick GPU check of seeds/sdpa/wgmma_flash.cu (Hopper: H100/H200), to find layout bugs fast.

Builds benchmarks/wgmma_probe.cu (which #includes the seed) with nvcc for sm_90a and runs:
  1. qk  D=64:  one m64nN S = q k^T tile (K-major A and B descriptors), N = 64 and 128;
  2. qk  D=128: the same over two 64-column panels;
  3. pv:        O = O_in + P v with P from registers and v MN-major (imm-trans-b = 1),
                D in {64, 128} x N in {64, 128};
     (1-3 in float16 and bfloat16, plus a case with zero-filled rows past the valid ones);
  4. sdpa:      the seed's evoattn_sdpa on (B,H,S,D,causal) shapes against float32 attention,
                for every combination of the structural knobs and every value of the others
                (probe_settings; each built separately, in parallel);
  5. plain:     the seed built for plain sm_90 (no wgmma) returns cudaErrorInvalidDeviceFunction
                instead of trapping.
Prints one line per test with the max abs error and PASS/FAIL, then a few informational
timings, and exits 1 on any FAIL (2 when it cannot run). Run from anywhere:
    python -m benchmarks.wgmma_probe [--quick] [--no-timing] [--watchdog]
--quick: only the seed's current knob setting. --watchdog: build with -DWGF_WATCHDOG (a
deadlocked warp-specialised pipeline traps instead of hanging).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import itertools
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT
from evoattn.contract.runtime import perf_notes
from evoattn.mutators.knobs import find_knobs, set_knobs as mutator_set

SEED = ROOT / "seeds" / "sdpa" / "wgmma_flash.cu"
PROBE = Path(__file__).resolve().parent / "wgmma_probe.cu"
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"
SDPA_SHAPES = [(1, 1, 64, 64, False), (1, 2, 200, 64, True), (2, 2, 513, 128, False),
               (1, 1, 1000, 128, True), (1, 3, 77, 64, False), (1, 1, 1, 64, False),
               (2, 2, 1000, 128, True), (1, 2, 300, 64, True),
               # more work items than an H100/H200 has SMs, so a persistent block takes several
               (4, 16, 1000, 128, True), (4, 24, 700, 64, False), (4, 24, 700, 64, True),
               # past a TMA_STORE_MAX_S of 1024, and past its default (4096): the st.global
               # epilogue in the same build
               (1, 2, 1300, 128, False), (2, 3, 1100, 128, True), (1, 2, 4099, 128, False),
               # SPLIT_TAIL_D64 on 132 SMs: the last wave's items in 3 and 2 parts of their keys
               (1, 12, 2497, 64, False), (1, 12, 2719, 64, False)]
TIME_SHAPES = [(4, 16, 4096, 128), (8, 32, 512, 64), (1, 32, 4096, 64)]
TOL = {"float16": 1e-2, "bfloat16": 4e-2, "float32": 1e-4}

DEVICE = "cuda"
failures = 0


def ptr(t):
    """A tensor's device address, as the ctypes entry points take it."""
    return ctypes.c_void_p(t.data_ptr())


def report(name: str, err: float, tol: float, extra: str = "") -> None:
    global failures
    ok = math.isfinite(err) and err <= tol
    failures += 0 if ok else 1
    print(f"{'PASS' if ok else 'FAIL'}  {name:<58} max_abs_err={err:.3e} (tol {tol:g}){extra}",
          flush=True)


def set_knobs(source: str, values: dict[str, str]) -> str:
    """Returns the seed with its knob lines set, as the mutator sets them; every one must change."""
    current = {k.name: k.value for k in find_knobs(source)}
    out = mutator_set(source, values)
    if any(current[n] != v for n, v in values.items()) and out == source:
        raise SystemExit("wgmma_probe: setting the knobs left the seed unchanged")
    return out


def build(seed: Path, out: Path, units: bool, watchdog: bool) -> tuple[Path, str, bool, float]:
    t0 = time.time()
    cmd = [os.environ.get("NVCC", "nvcc"), "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
           GENCODE, "-Xptxas", "-v", f'-DWGF_SEED="{seed}"', f"-DWGF_PROBE_UNITS={int(units)}",
           f"-I{SEED.parent}",                                   # the seed's companion header
           *(["-DWGF_WATCHDOG"] if watchdog else []), "-o", str(out), str(PROBE)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    return out, p.stdout + p.stderr, p.returncode == 0 and out.is_file(), time.time() - t0


def ptxas_summary(log: str) -> str:
    """Registers / spills of the seed's wgmma kernels, from the -Xptxas -v log."""
    lines, fn = [], ""
    for line in log.splitlines():
        if "Compiling entry function" in line:
            fn = line.split("'")[1] if "'" in line else ""
        elif "Used" in line and "registers" in line and "wgmma_flash_kernel" in fn:
            regs = line.split("Used")[1].split("registers")[0].strip()
            ints = re.findall(r"Li(\d+)E", fn)          # template ints: D, then BLOCK_N
            kind = ("bf16" if "bfloat16" in fn else "f16") + "/D" + "/N".join(ints)
            lines.append(f"{kind}:{regs}")
        elif "spill" in line and "wgmma_flash_kernel" in fn and any(
                w.isdigit() and int(w) > 0 for w in line.split()):
            lines.append(f"SPILL/STACK({line.strip()})")
    # ptxas reports serialised wgmma and waits it injected as info, not as warnings
    warn = [l.strip() for l in log.splitlines() if "warning" in l.lower()] + perf_notes(log)
    return "regs " + " ".join(lines) + ("" if not warn else "  WARNINGS: " + " | ".join(warn))


# Knobs whose every combination is built (they change the kernel's structure together); every
# other knob is built one value at a time, the rest at the seed's values.
STRUCTURAL = ("WARP_SPECIALIZE_D64", "WARP_SPECIALIZE_D128", "OVERLAP_D64", "OVERLAP_D128")
# Knobs of the warp-specialised path that also run with it switched on at both head dims (the
# one-at-a-time settings keep the seed's path, which may not use them at one head dim), and
# together with the other ones that change its item and turn loops.
WS_INTERACTIONS = ({"PERSISTENT_D64": "1", "PERSISTENT_D128": "1"},
                   {"PERSISTENT_D64": "1", "PERSISTENT_D128": "1", "PERSISTENT_DYNAMIC": "0"},
                   {"PERSISTENT_D64": "1", "PERSISTENT_D128": "1", "PINGPONG": "1"},
                   {"PERSISTENT_D64": "1", "PERSISTENT_D128": "1", "OVERLAP_D64": "1",
                    "OVERLAP_D128": "0", "WS_STAGES_D64": "3", "WS_STAGES_D128": "3",
                    "TMA_STORE_MAX_S": "0", "Q_DOUBLE_MAX_S_D128": "0"},
                   {"PINGPONG": "1", "WS_STAGES_D64": "3", "WS_STAGES_D128": "3",
                    "TMA_STORE_MAX_S": "0", "Q_DOUBLE_MAX_S_D128": "0"},
                   {"PERSISTENT_D64": "1", "PERSISTENT_D128": "1", "PINGPONG": "1",
                    "Q_DOUBLE_MAX_S_D64": "65536", "Q_DOUBLE_MAX_S_D128": "65536"})


def probe_settings(knobs) -> list[dict[str, str]]:
    """Returns the knob settings to build: every combination of the STRUCTURAL knobs, then each
    other knob's other values one at a time (the full product is hundreds of builds), then the
    WS_INTERACTIONS with the warp-specialised path at both head dims."""
    cur = {k.name: k.value for k in knobs}
    structural = [k for k in knobs if k.name in STRUCTURAL]
    out = []
    for combo in itertools.product(*(k.choices for k in structural)):
        out.append({**cur, **dict(zip((k.name for k in structural), combo))})
    for k in knobs:
        if k.name not in STRUCTURAL:
            out.extend({**cur, k.name: v} for v in k.choices if v != k.value)
    both_ws = {"WARP_SPECIALIZE_D64": "1", "WARP_SPECIALIZE_D128": "1"}
    for extra in WS_INTERACTIONS:
        setting = {**cur, **both_ws, **extra}
        if setting not in out:
            out.append(setting)
    return out


SMEM_OPTIN_BYTES = 232448                    # H100/H200: 227 KB of shared memory per block


def load(so: Path) -> ctypes.CDLL:
    """A built probe library, with its 64-bit return type and arguments declared."""
    lib = ctypes.CDLL(str(so))
    lib.probe_ws_smem_bytes.restype = ctypes.c_longlong
    lib.probe_tail_parts.argtypes = [ctypes.c_longlong] * 3
    return lib


def fits_shared_memory(lib, vals: dict[str, str], D: int) -> bool:
    """Whether the warp-specialised kernel's shared memory fits a block, as the built library
    (`lib`, with these knob values `vals`) computes it (WsSmem in the seed)."""
    if vals[f"WARP_SPECIALIZE_D{D}"] != "1":
        return True
    return lib.probe_ws_smem_bytes(D) <= SMEM_OPTIN_BYTES


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only the seed's current knob setting")
    ap.add_argument("--no-timing", action="store_true", help="skip the informational timings")
    ap.add_argument("--watchdog", action="store_true",
                    help="build with -DWGF_WATCHDOG: a deadlocked mbarrier wait traps instead of "
                         "hanging (the extra branch can cost spills: timings are then not the "
                         "normal build's)")
    return ap.parse_args()


def cannot_run() -> str | None:
    """Returns why this machine cannot run the probe (no CUDA, not sm_9x, no nvcc), or None."""
    import torch
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability()
    print(f"device {torch.cuda.get_device_name()} capability {cap}, torch {torch.__version__}")
    if cap[0] != 9:
        return "not a compute-capability-9.x GPU: the wgmma path cannot run here"
    if shutil.which(os.environ.get("NVCC", "nvcc")) is None:
        return "nvcc not found"
    return None


def build_all(tmp: Path, quick: bool, watchdog: bool) -> list[tuple[str, dict, ctypes.CDLL]] | None:
    """Builds the seed as it is (with the unit kernels) and, unless `quick`, every other knob
    setting, in parallel; returns (label, knob values, library) each, None when one fails."""
    seed_src = SEED.read_text()
    knobs = find_knobs(seed_src)                 # every knob setting of the seed, as it is now
    cur = {k.name: k.value for k in knobs}
    jobs = [(dict(cur), SEED, tmp / "probe_default.so", True)]
    if not quick:
        for i, vals in enumerate(probe_settings(knobs)):
            if vals == cur:
                continue
            # numbered, not named by the settings: nvcc's temporary file names add to the
            # name, and a name with every knob outgrew the 255-byte limit
            path = tmp / f"seed_{i:03d}.cu"
            path.write_text(set_knobs(seed_src, vals))
            jobs.append((vals, path, tmp / f"probe_{i:03d}.so", False))
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        built = list(ex.map(lambda j: build(j[1], j[2], j[3], watchdog), jobs))
    print(f"built {len(jobs)} libraries in {time.time() - t0:.0f}s")
    libs = []
    for (vals, _, _, _), (so, log, ok, secs) in zip(jobs, built):
        label = ",".join(f"{k}={v}" for k, v in vals.items())
        if not ok:
            print(f"FAIL  build {label}\n{log[-3000:]}")
            return None
        print(f"      build {label}: {secs:.0f}s, {ptxas_summary(log)}")
        libs.append((label, vals, load(so)))
    return libs


def check_qk(unit: ctypes.CDLL, gen, stream) -> None:  # noqa: ANN001
    """1, 2: S = q k^T, D = 64 and 128, with and without zero-filled rows past the valid ones."""
    import torch
    for D in (64, 128):
        for N in (64, 128):
            for (dname, dt), k_rows in itertools.product(_dtypes(), (N, N - 13)):
                if dname == "bfloat16" and k_rows != N:
                    continue
                q = torch.randn(64, D, device=DEVICE, generator=gen).to(dt)
                k = torch.randn(N, D, device=DEVICE, generator=gen).to(dt)
                s = torch.full((64, N), float("nan"), device=DEVICE)
                rc = unit.probe_qk(ptr(q), ptr(k), ptr(s), D, N, int(dname == "bfloat16"),
                                   k_rows, stream)
                torch.cuda.synchronize()
                kz = k.float().clone()
                kz[k_rows:] = 0
                ref = q.float() @ kz.T
                err = (s - ref).abs().max().item() if rc == 0 else float("inf")
                report(f"{'1' if D == 64 else '2'} qk D={D} N={N} {dname} k_rows={k_rows}",
                       err, 1e-2, f" rc={rc}" if rc else "")


def check_pv(unit: ctypes.CDLL, gen, stream) -> None:  # noqa: ANN001
    """3: O = O_in + P v, P from registers, v MN-major."""
    import torch
    for D in (64, 128):
        for N in (64, 128):
            for (dname, dt), v_rows in itertools.product(_dtypes(), (N, N - 13)):
                if dname == "bfloat16" and v_rows != N:
                    continue
                p = torch.rand(64, N, device=DEVICE, generator=gen).to(dt).float()
                v = torch.randn(N, D, device=DEVICE, generator=gen).to(dt)
                o_in = torch.randn(64, D, device=DEVICE, generator=gen)
                o = torch.full((64, D), float("nan"), device=DEVICE)
                rc = unit.probe_pv(ptr(p), ptr(v), ptr(o_in), ptr(o), D, N,
                                   int(dname == "bfloat16"), v_rows, stream)
                torch.cuda.synchronize()
                vz = v.float().clone()
                vz[v_rows:] = 0
                ref = o_in + p @ vz
                err = (o - ref).abs().max().item() if rc == 0 else float("inf")
                report(f"3 pv D={D} N={N} {dname} v_rows={v_rows}", err, 1e-2,
                       f" rc={rc}" if rc else "")


def check_sdpa(libs: list[tuple[str, dict, ctypes.CDLL]], gen, stream) -> None:  # noqa: ANN001
    """4: the whole seed, every build, against float32 attention."""
    import torch
    codes = {"float16": 0, "bfloat16": 1, "float32": 2}
    for label, vals, lib in libs:
        for (B, H, S, D, causal), (dname, dt) in itertools.product(
                SDPA_SHAPES, _dtypes() + [("float32", torch.float32)]):
            if dname == "float32" and (B, H, S, D, causal) != (1, 2, 200, 64, True):
                continue                  # the fallback: one shape is enough
            if dname == "bfloat16" and S not in (200, 1000):
                continue
            q, k, v = (torch.randn(B, H, S, D, device=DEVICE, generator=gen).to(dt)
                       for _ in range(3))
            out = torch.full_like(q, float("nan"))
            scale = 1.0 / math.sqrt(D)
            rc = lib.evoattn_sdpa(ptr(q), ptr(k), ptr(v), ptr(out), B, H, S, D, codes[dname],
                                  int(causal), ctypes.c_float(scale), stream)
            torch.cuda.synchronize()
            name = f"4 sdpa [{label}] ({B},{H},{S},{D}){' causal' if causal else ''}"
            if dname != "float32" and not fits_shared_memory(lib, vals, D):
                # more ring stages than shared memory: the seed must fail cleanly, with
                # cudaFuncSetAttribute's cudaErrorInvalidValue (1)
                report(f"{name} {dname}: too much shared memory, rc={rc}",
                       0.0 if rc == 1 else float("inf"), 0.0)
                continue
            sc = (q.float() @ k.float().transpose(-1, -2)) * scale
            if causal:
                sc = sc.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=DEVICE).tril(),
                                    float("-inf"))
            ref = torch.softmax(sc, dim=-1) @ v.float()
            err = (out.float() - ref).abs().max().item() if rc == 0 else float("inf")
            report(f"{name} {dname}", err, TOL[dname], f" rc={rc}" if rc else "")


def check_plain(tmp: Path, gen, stream) -> bool:  # noqa: ANN001
    """5: built for plain sm_90 (no wgmma), the seed says so instead of trapping; False when
    that build fails."""
    import torch
    plain = tmp / "seed_plain_sm90.so"
    p = subprocess.run([os.environ.get("NVCC", "nvcc"), "-O3", "-std=c++17", "-shared",
                        "-Xcompiler", "-fPIC", "-arch=sm_90", "-o", str(plain), str(SEED)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        print(f"FAIL  build for plain sm_90\n{p.stderr[-2000:]}")
        return False
    q = torch.randn(1, 2, 128, 64, device=DEVICE, generator=gen).half()
    out = torch.empty_like(q)
    rc = ctypes.CDLL(str(plain)).evoattn_sdpa(ptr(q), ptr(q), ptr(q), ptr(out), 1, 2, 128,
                                              64, 0, 0, ctypes.c_float(0.125), stream)
    torch.cuda.synchronize()              # the context must still be healthy
    report("5 plain sm_90 build returns cudaErrorInvalidDeviceFunction (98)",
           0.0 if rc == 98 else float("inf"), 0.0, f" rc={rc}")
    return True


def timings(libs: list[tuple[str, dict, ctypes.CDLL]], gen, stream) -> None:  # noqa: ANN001
    """Informational float16 timings of every build against SDPA (not PASS/FAIL)."""
    import torch
    import torch.nn.functional as F
    for (B, H, S, D) in TIME_SHAPES:
        for causal in (False, True):
            q, k, v = (torch.randn(B, H, S, D, device=DEVICE, generator=gen).half()
                       for _ in range(3))
            out = torch.empty_like(q)
            flops = 4.0 * B * H * S * S * D / (2 if causal else 1)
            cells = []
            for label, vals, lib in libs:
                if not fits_shared_memory(lib, vals, D):
                    continue              # fails cleanly (checked above); nothing to time

                def call(lib: ctypes.CDLL = lib) -> None:
                    lib.evoattn_sdpa(ptr(q), ptr(k), ptr(v), ptr(out), B, H, S, D, 0,
                                     int(causal), ctypes.c_float(1 / math.sqrt(D)), stream)
                cells.append((label, _time(call)))
            t_ref = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            row = "  ".join(f"[{l}] {flops / t / 1e12:.0f}" for l, t in cells)
            print(f"time ({B},{H},{S},{D}){' causal' if causal else '       '} TFLOP/s: {row}"
                  f"  torch-sdpa {flops / t_ref / 1e12:.0f}", flush=True)


def _dtypes() -> list[tuple[str, object]]:
    import torch
    return [("float16", torch.float16), ("bfloat16", torch.bfloat16)]


def main() -> int:
    args = parse_args()
    why = cannot_run()
    if why is not None:
        print(f"FAIL  {why}")
        return 2
    import torch
    tmp = Path(tempfile.mkdtemp(prefix="wgmma_probe_"))
    libs = build_all(tmp, args.quick, args.watchdog)
    if libs is None:
        return 1
    gen = torch.Generator(device=DEVICE).manual_seed(1234)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    try:
        check_qk(libs[0][2], gen, stream)
        check_pv(libs[0][2], gen, stream)
        check_sdpa(libs, gen, stream)
        if not check_plain(tmp, gen, stream):
            return 1
    except Exception as e:                     # a trap / illegal address kills the context
        print(f"FAIL  CUDA error: {type(e).__name__}: {e}")
        return 1
    if not args.no_timing and failures == 0:
        timings(libs, gen, stream)
    print(f"{'ALL PASS' if failures == 0 else f'{failures} FAILED'}")
    return 0 if failures == 0 else 1


def _time(fn, reps: int = 20) -> float:
    import torch
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


if __name__ == "__main__":
    sys.exit(main())
