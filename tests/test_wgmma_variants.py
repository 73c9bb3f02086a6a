"""benchmarks/wgmma_variants.py: its --variant grammar and its refusals without a GPU; on a
Hopper GPU (gpu marker) a real run of two settings."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "wgmma_variants.py"


def _module():
    spec = importlib.util.spec_from_file_location("wgmma_variants", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod              # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_a_variant_is_a_name_an_optional_file_and_knob_settings(tmp_path):
    wv = _module()
    assert wv.parse_variant("seed:") == wv.Variant("seed", wv.SEED, ())
    assert wv.parse_variant("old:OVERLAP_D128=0, TMA_STORE_MAX_S=1024") == wv.Variant(
        "old", wv.SEED, ("OVERLAP_D128=0", "TMA_STORE_MAX_S=1024"))
    other = tmp_path / "old.cu"
    other.write_text(wv.SEED.read_text())
    assert wv.parse_variant(f"prev:@{other},PINGPONG=1") == wv.Variant(
        "prev", other, ("PINGPONG=1",))
    for bad in ("noname", ":OVERLAP_D128=0", "x:OVERLAP_D128", f"x:@{tmp_path / 'missing.cu'}"):
        with pytest.raises(ValueError, match="--variant"):
            wv.parse_variant(bad)


@pytest.mark.parametrize("args, message", [
    (["--variant", "a:NO_SUCH_KNOB=1"], "NO_SUCH_KNOB"),
    (["--variant", "a:OVERLAP_D128=7"], "OVERLAP_D128"),
    (["--variant", "a:", "--variant", "a:PINGPONG=1"], "names must differ"),
    (["--variant", "a:", "--config", "1,2,3"], "expected B,H,S,D[,causal]"),
    (["--variant", "a:", "--config", "1,16,0,128"], "expected B,H,S,D[,causal]"),
    (["--variant", "a:", "--config", "1,16,512,96"], "with D 64 or 128"),
    (["--variant", "a:", "--config", "1,16,512,64,nc"], "expected B,H,S,D[,causal]"),
])
def test_bad_variants_are_one_line_and_exit_2_before_any_gpu_work(args, message, capsys):
    pytest.importorskip("torch")
    assert _module().main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_config_is_the_problems_dict():
    wv = _module()
    assert wv.parse_config("1,16,16384,128") == {"B": 1, "H": 16, "S": 16384, "D": 128,
                                                 "causal": False}
    assert wv.parse_config(" 8, 32, 512, 64, causal")["causal"] is True


def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert _module().main(["--variant", "seed:"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_two_settings_build_check_and_time_on_hopper(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper (sm_90) GPU")
    out = tmp_path / "v.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--variant", "seed:", "--variant",
                           "no_overlap:OVERLAP_D128=0", "--head-dim", "128", "--rounds", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "checks: 0 failed" in proc.stdout and "geomean vs sdpa, graph, D=128" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all({"sdpa", "seed", "no_overlap"} <= set(r["ms"]) for r in rows)
