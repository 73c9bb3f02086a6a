#!/usr/bin/env python3
"""Where the warp-specialised wgmma kernel's warps wait: Nsight Compute's stall samples per
mbarrier and per instruction (no GPU needed to read a report).

    ncu --section SourceCounters --section WarpStateStats --kernel-name regex:wgmma_ws \\
        --launch-skip 1 --launch-count 1 -o REP python -m benchmarks.ncu_seed \\
        seeds/sdpa/wgmma_flash.cu --config 8,32,512,64
    ncu -i REP.ncu-rep --page source --csv --print-source sass > SRC.csv
    python -m benchmarks.ncu_waits SRC.csv [--top 20]

Reads the SASS source page: every `SYNCS.PHASECHK...TRYWAIT` names an mbarrier by its
shared-memory offset, and its samples, with those of the branch that retries it, are that
barrier's wait. The seed lays its barriers out after its tiles (WsSmem in wgmma_flash.cu): per q
tile a full and an empty barrier, then per k/v stage k full, v full, k empty, v empty, 8 bytes
each; the lowest offset waited on is the first q tile's. The number of q tiles is the kernel's
last template argument. A wait whose address adds a register names its stage at run time: it is
listed as stage 0 plus "+reg". Prints each barrier's share of all samples, then the
instructions with the most samples. Exits 2 on a file it cannot read.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
WAIT = re.compile(r"SYNCS\.PHASECHK\S*TRYWAIT\s+\S+,\s*\[([^\]]*)\]")
OFFSET = re.compile(r"0x([0-9a-fA-F]+)\s*$")
STAGE_BARRIERS = ("k full", "v full", "k empty", "v empty")


def read_source_page(path: Path) -> tuple[str, list[tuple[str, float]]]:
    """(kernel name, [(SASS text, stall samples)] in address order) from `--page source --csv`;
    ValueError with one line when the file is not such a page."""
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 3 or rows[0][:1] != ["Kernel Name"] or SAMPLES not in rows[1] \
            or "Source" not in rows[1]:
        raise ValueError(f"{path}: not an ncu source page (--page source --csv --print-source sass)")
    src, smp = rows[1].index("Source"), rows[1].index(SAMPLES)
    return rows[0][1], [(r[src].strip(), float(r[smp] or 0)) for r in rows[2:] if len(r) > smp]


def q_tiles(kernel: str) -> int:
    """The kernel's q tiles: its last template argument (wgmma_ws_kernel<T, D, BN, OV, QB>); 1
    for a kernel name without it."""
    args = re.findall(r"\(int\)(\d+)", kernel)
    return int(args[-1]) if len(args) >= 3 else 1


def barrier_name(offset: int, base: int, qb: int) -> str:
    rel = offset - base
    if rel < 16 * qb:
        return f"q{rel // 16} {'full' if rel % 16 == 0 else 'empty'}"
    rel -= 16 * qb
    return f"stage {rel // 32} {STAGE_BARRIERS[(rel % 32) // 8]}"


def waits(lines: list[tuple[str, float]], qb: int) -> dict[str, float]:
    """Stall samples per barrier: each TRYWAIT's own and its retry branch's (the next line)."""
    found = []                                   # (offset, via a register, samples)
    for i, (text, n) in enumerate(lines):
        m = WAIT.search(text)
        if not m:
            continue
        off = OFFSET.search(m.group(1))
        if not off:
            continue
        after = lines[i + 1] if i + 1 < len(lines) else ("", 0.0)
        n += after[1] if re.search(r"\bBRA\b", after[0]) else 0.0
        via_register = re.search(r"(?<![U\w])R\d+", m.group(1)) is not None
        found.append((int(off.group(1), 16), via_register, n))
    if not found:
        return {}
    base = min(o for o, _, _ in found)
    out: Counter[str] = Counter()
    for off, reg, n in found:
        out[barrier_name(off, base, qb) + (" +reg" if reg else "")] += n
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--top", type=int, default=20, help="instructions to list")
    a = ap.parse_args(argv)
    try:
        kernel, lines = read_source_page(a.csv)
    except (OSError, ValueError, csv.Error) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = sum(n for _, n in lines) or 1.0
    qb = q_tiles(kernel)
    print(f"{kernel}\n{total:.0f} stall samples, {qb} q tile(s)")
    for name, n in sorted(waits(lines, qb).items(), key=lambda kv: -kv[1]):
        print(f"  wait {name:22s} {100 * n / total:5.1f}%")
    for text, n in sorted(lines, key=lambda tn: -tn[1])[:a.top]:
        print(f"  {100 * n / total:5.1f}%  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
