"""benchmarks.wgmma_variants: its --variant grammar and its refusals without a GPU; on a
Hopper GPU (gpu marker) a real run of two settings."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE = "benchmarks.wgmma_variants"


def _module():
    from benchmarks import wgmma_variants
    return wgmma_variants


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
    (["--variant", "a:", "--rounds", "0"], "--rounds must be at least 1"),
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


def test_the_paired_gain_is_the_median_of_the_rounds_ratios_with_its_interval():
    pytest.importorskip("numpy")
    wv = _module()
    # every round the first is 10% faster, while the whole machine drifts 20% between rounds:
    # the rounds' ratios see no drift, so the interval is the point
    first = [1.0, 1.2, 1.0, 1.2, 1.1, 1.0, 1.2]
    other = [1.1 * t for t in first]
    point, ci = wv.paired_gain(first, other)
    assert point == pytest.approx(1.1) and ci == pytest.approx((1.1, 1.1))
    # the same medians from unpaired noise: a gain this run cannot tell from 1
    other = [1.3, 1.0, 1.25, 1.05, 1.2, 1.3, 1.0]
    point, ci = wv.paired_gain(first, other)
    assert ci[0] < 1.0 < ci[1]
    assert wv.fmt_gain((point, ci)).startswith(f"{point:.3f}x [")
    assert wv.fmt_gain((1.05, None)) == "1.050x"


def test_the_geomean_gain_over_configs_carries_an_interval():
    pytest.importorskip("numpy")
    wv = _module()
    g, ci = wv.geomean_gain([(1.1, (1.05, 1.15)), (1.0, (0.95, 1.05))])
    assert g == pytest.approx((1.1 * 1.0) ** 0.5)
    assert ci[0] < g < ci[1] and ci[1] - ci[0] < 0.1    # narrower than either config's
    assert wv.geomean_gain([(1.1, None), (1.0, (0.9, 1.1))])[1] is None


def test_the_summary_gives_speedups_and_paired_gains_per_head_dim():
    pytest.importorskip("numpy")
    wv = _module()

    def row(d, sdpa, new, old):
        samples = {"sdpa": {"graph": sdpa}, "new": {"graph": new}, "old": {"graph": old}}
        return {"cfg": {"B": 1, "H": 8, "S": 512, "D": d, "causal": False},
                "ms": wv.medians(samples), "samples": samples}
    rows = [row(64, [2.0, 2.0, 2.0], [1.0, 1.1, 1.0], [1.2, 1.32, 1.2]),
            row(128, [3.0, 3.0, 3.0], [3.0, 3.0, 3.3], [3.0, 3.0, 3.3])]
    lines = wv.summary_lines(rows, ["new", "old"], "new", ["old"], ("graph",))
    text = "\n".join(lines)
    assert "geomean vs sdpa, graph, D=64: new 2.0000x  old 1.6667x" in text
    assert "paired gain, graph, D=64: new vs old 1.200x [1.200, 1.200]" in text
    assert "paired gain, graph, D=128: new vs old 1.000x [1.000, 1.000]" in text
    assert any(ln.startswith("paired gain, graph, all: new vs old 1.095x [") for ln in lines)
    # one variant alone: speedups, no gains
    assert not any("paired" in ln for ln in wv.summary_lines(rows, ["new"], "new", [], ("graph",)))


def test_medians_per_function_and_mode():
    wv = _module()
    assert wv.medians({"a": {"graph": [3.0, 1.0, 2.0], "eager": [5.0]}}) == {
        "a": {"graph": 2.0, "eager": 5.0}}


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
    wv = _module()
    out = tmp_path / "v.json"
    proc = subprocess.run([sys.executable, "-m", MODULE, "--variant", "seed:", "--variant",
                           "no_overlap:OVERLAP_D128=0", "--head-dim", "128", "--rounds", "2",
                           "--json", str(out)], capture_output=True, cwd=ROOT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "checks: 0 failed" in proc.stdout and "geomean vs sdpa, graph, D=128" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all({"sdpa", "seed", "no_overlap"} <= set(r["ms"]) for r in rows)
    assert all(len(r["samples"][n]["graph"]) == 2 for r in rows for n in ("seed", "no_overlap"))
    # the printed paired gain is the one the rounds' samples give, per config and over them
    gains = [wv.paired_gain(r["samples"]["seed"]["graph"], r["samples"]["no_overlap"]["graph"])
             for r in rows]
    line = next(ln for ln in proc.stdout.splitlines()
                if ln.startswith("paired gain, graph, D=128: seed vs no_overlap "))
    assert line.split("no_overlap ")[1].split("x")[0] == f"{wv.geomean_gain(gains)[0]:.3f}"
