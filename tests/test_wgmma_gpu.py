"""The wgmma seed's operand layouts and every knob setting, on a Hopper GPU
(benchmarks.wgmma_probe)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
def test_wgmma_probe_passes_on_hopper() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper (sm_90) GPU")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.wgmma_probe", "--no-timing"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "ALL PASS" in proc.stdout and "FAIL" not in proc.stdout.replace("ALL PASS", "")


@pytest.mark.gpu
def test_float16_and_bfloat16_take_the_same_cuda_route_and_pass() -> None:
    """benchmarks.check_bf16_cuda: the default program and wgmma_flash.cu in both dtypes."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper (sm_90) GPU")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.check_bf16_cuda", "--no-timing",
                           "--trials", "1"], capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "ALL PASS" in proc.stdout
    # bfloat16 reached the wgmma kernel (not only the Triton or CUDA-core paths)
    assert any(" bfloat16 " in line and " wgmma" in line for line in proc.stdout.splitlines())
