"""The sliding_window seed launches per chunk of heads past a grid axis's 65535 limit: with the
limit lowered to 4, fifteen heads take four launches and must still all be right."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = '''
import importlib.util, torch
spec = importlib.util.spec_from_file_location("w", "seeds/sliding_window/window_triton.py")
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
m.MAX_HEADS_PER_LAUNCH = 4
grids = []
kernel = m._window_fwd


class Counted:                      # records each launch's grid, then launches
    def __getitem__(self, grid):
        grids.append(grid)
        return kernel[grid]


m._window_fwd = Counted()
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(3, 5, 70, 64, generator=g) for _ in range(3))
i = torch.arange(70)
keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 9)
s = (q.double() @ k.double().transpose(-1, -2)) * 0.125
ref = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v.double()
err = (m.attention(q, k, v, 9, scale=0.125).double() - ref).abs().max().item()
print([g[1] for g in grids])
print(err)
'''


def test_every_chunk_of_heads_is_computed() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-2] == "[4, 4, 4, 3]", lines[-2]        # heads per launch
    assert float(lines[-1]) < 1e-5
