"""The `masked` seed's work lists, on masks of every broadcast shape, in Triton's interpreter.

The evaluator's configs exercise three mask shapes; the contract allows any 4-D mask
broadcastable to (B, H, Sq, Sk). Here the seed runs (in a child process with
TRITON_INTERPRET=1, see test_seeds_triton.py for why) on each shape, with dead, all-zero
and finite-bias tiles, odd Sq/Sk and several knob settings, against float64. The TMA path
(tensor descriptors) is forced through the interpreter too; on a GPU it runs only on sm_90+.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "seeds" / "masked" / "masked_triton.py"
SHAPES = [(2, 3, 70, 150, 64), (1, 2, 129, 64, 128)]
MASKS = ["B11K", "1HQK", "BHQK", "B1Q1", "1111", "11QK"]     # which dims the mask has
SETTINGS = [{}, {"BLOCK_M": "16", "BLOCK_N": "128"},
            {"BLOCK_M": "128", "BLOCK_N": "32", "FULL_TILES": "False", "USE_EXP2": "False"}]


def child(cases_path: str, out_path: str) -> None:
    import importlib.util
    import torch
    sys.path.insert(0, str(ROOT))
    from evoattn.mutators.knobs import set_knobs
    results = []
    for i, (knobs, shape, mdims, mutation, tma) in enumerate(json.loads(Path(cases_path).read_text())):
        text = set_knobs(SEED.read_text(), knobs)
        if mutation:
            assert text.count(mutation[0]) == 1, mutation[0]
            text = text.replace(*mutation)
        path = Path(out_path).parent / f"seed_{i}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"seed_{i}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        B, H, Sq, Sk, D = shape
        g = torch.Generator().manual_seed(i)
        q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (Sq, Sk, Sk))
        full = {"B": B, "H": H, "Q": Sq, "K": Sk, "1": 1}
        mshape = tuple(full[c] if c in "BHQK" else 1 for c in mdims)
        r = torch.rand(mshape, generator=g)
        mask = torch.where(r < 0.5, 0.0, torch.where(r < 0.8, float("-inf"),
                                                     torch.randn(mshape, generator=g)))
        mask[..., : min(mshape[2], 64), : min(mshape[3], 64)] = 0.0    # some all-zero tiles
        mask[..., 0] = torch.where(mask[..., 0].isinf(), 0.0, mask[..., 0])  # no empty row
        errs = []
        for dtype in (torch.float32, torch.float16):
            args = [t.to(dtype) for t in (q, k, v, mask)]
            out = mod._forward(*args, 0.125, use_tma=tma)
            qd, kd, vd, md = (t.double() for t in args)
            ref = torch.softmax(qd @ kd.transpose(-1, -2) * 0.125 + md, -1) @ vd
            errs.append((out.double() - ref).abs().max().item())
        results.append(errs)
    Path(out_path).write_text(json.dumps(results))


def run(cases: list) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, out_path = Path(tmp, "cases.json"), Path(tmp, "out.json")
        cases_path.write_text(json.dumps(cases))
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, __file__, str(cases_path), str(out_path)],
                              env=env, capture_output=True, text=True, timeout=550)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(out_path.read_text())


def ok(errs: list) -> bool:
    return errs[0] < 1e-5 and errs[1] < 4e-3          # float32, float16 (p rounded to fp16)


@pytest.mark.slow
def test_masked_seed_is_right_for_every_mask_shape_and_setting() -> None:
    cases = [(s, shape, m, None, False) for s in SETTINGS for shape in SHAPES for m in MASKS]
    cases += [(s, shape, m, None, True) for s in SETTINGS[:2] for shape in SHAPES
              for m in ("B11K", "BHQK")]
    bad = [(c, e) for c, e in zip(cases, run(cases)) if not ok(e)]
    assert not bad, bad


@pytest.mark.slow
def test_the_check_catches_a_tile_mislabelled_full() -> None:
    # every live tile inside Sk labelled full: its bias (finite values and -inf entries) is never
    # added. Tiles reaching past Sk keep their label, so the wrong kernel reads no memory past k
    # and v (an unmasked read there can crash the interpreter instead of giving a wrong answer).
    wrong = ("label = tl.where(full & (n_live > 0), 1, label)",
             "label = tl.where(((kb + 1) * BLOCK_N <= Sk) & (n_live > 0), 1, label)")
    cases = [({}, SHAPES[0], m, wrong, False) for m in ("BHQK", "B11K")]
    assert not any(ok(e) for e in run(cases))


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
