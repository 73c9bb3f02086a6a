"""benchmarks.ncu_waits on a source page written as Nsight Compute writes one (CPU only)."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE = "benchmarks.ncu_waits"
KERNEL = ("void wgmma_ws_kernel<__half, (int)64, (int)128, (bool)0, (int)2>(CUtensorMap_st, "
          "CUtensorMap_st, CUtensorMap_st, CUtensorMap_st, T1 *, int, int, int, float, int *, "
          "int, int, HeadLayout)")


def _module():
    from benchmarks import ncu_waits
    return ncu_waits


def _page(path: Path, kernel: str, lines: list[tuple[str, float]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", kernel])
        w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)",
                    "Warp Stall Sampling (Not-issued Samples)", "# Samples"])
        for i, (text, n) in enumerate(lines):
            w.writerow([hex(0x7f0000 + 16 * i), text, str(n), str(n), str(n)])
    return path


# Barriers of a kernel with two q tiles at 0x1c000: q0 full/empty, q1 full/empty (0x1c010,
# 0x1c018), then per stage k full, v full, k empty, v empty from 0x1c020.
LINES = [
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR13+0x1c000], R3", 2.0),       # q0 full
    ("@!P0  BRA 0x7fd6377b7ab0", 30.0),                                   # ... its retries
    ("HGMMA.64x64x16.F32 R88, R24, gdesc[UR16].tnspB, R88", 40.0),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x1c018], R24", 1.0),       # q1 empty
    ("MUFU.EX2 R33, R33", 7.0),                                           # not a retry
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R18+URZ+0x1c048], R13", 0.0),   # stage 1 v full
    ("@!P0  BRA 0x7fd6377b84f0", 20.0),
]


def test_waits_are_named_by_the_seeds_barrier_layout(tmp_path):
    mod = _module()
    kernel, lines = mod.read_source_page(_page(tmp_path / "src.csv", KERNEL, LINES))
    assert kernel == KERNEL and mod.q_tiles(kernel) == 2
    assert mod.waits(lines, 2) == {"q0 full": 32.0, "q1 empty": 1.0, "stage 1 v full +reg": 20.0}
    # the same offsets with one q tile: 0x1c018 is then stage 0's v full, 0x1c048 stage 1's v
    # empty; a kernel name without the q-tile argument has one
    assert mod.q_tiles(KERNEL.replace(", (int)2>", ">")) == 1
    assert mod.waits(lines, 1) == {"q0 full": 32.0, "stage 0 v full": 1.0,
                                   "stage 1 v empty +reg": 20.0}


def test_the_report_prints_shares_and_a_bad_file_gets_one_line(tmp_path):
    page = _page(tmp_path / "src.csv", KERNEL, LINES)
    proc = subprocess.run([sys.executable, "-m", MODULE, str(page), "--top", "2"],
                          capture_output=True, cwd=ROOT, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert "100 stall samples, 2 q tile(s)" in out[1]
    assert "wait q0 full" in out[2] and out[2].endswith("32.0%")
    assert out[-2].strip() == "40.0%  HGMMA.64x64x16.F32 R88, R24, gdesc[UR16].tnspB, R88"
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    proc = subprocess.run([sys.executable, "-m", MODULE, str(bad)], capture_output=True,
                          cwd=ROOT, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "not an ncu source page" in proc.stderr
