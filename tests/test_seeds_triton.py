"""Checks the `sdpa` seeds (naive_torch, flash_triton) against a float64 reference.

The checks run in a child process: this file, run as a script. Triton reads
TRITON_INTERPRET when it is first imported, other test modules may import it
before this one, and setting the variable in the pytest process would make any
later GPU test run interpreted. So only the child gets TRITON_INTERPRET=1 (for
CPU tensors), set in its environment before it imports torch or triton.

Knob combinations of flash_triton are tested on rewritten temporary copies of the
file, the way the mutator changes it: only the value on a `# evoattn:` line.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEEDS_DIR = ROOT / "seeds" / "sdpa"
# Max abs error allowed against float64, per input dtype. A flash kernel rounds p to the input
# dtype before P·V (unit roundoff 2^-11 in float16, 2^-8 in bfloat16), so these are a few times
# the error seen at these sizes; a mask or rescaling bug gives errors of 0.1 and more.
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}
KNOB_LINE = re.compile(r"^(?P<name>[A-Z][A-Z0-9_]*) = (?P<value>\S+)  # evoattn: "
                       r"choice\((?P<choices>[^)]*)\)(?: when\([^)]*\))*$", re.MULTILINE)
# Errors that count as failing cleanly on a GPU (a knob setting Triton cannot build for that
# dtype: too much shared memory, a warp-specialisation pass failure), not as bugs.
CLEAN_FAILURES = ("WarpSpecializeError", "OutOfResources")


# ---- child side ---------------------------------------------------------------------
def knob_values(text: str) -> dict[str, tuple[str, list[str]]]:
    """Returns {knob: (current value, choices)} for the annotated lines of a seed's source."""
    return {m["name"]: (m["value"], [c.strip() for c in m["choices"].split(",")])
            for m in KNOB_LINE.finditer(text)}


def set_knobs(text: str, knobs: dict[str, Any]) -> str:
    """Returns the source with the values of the named knob lines replaced, as the mutator does."""
    known = knob_values(text)
    for name, value in knobs.items():
        if name not in known:
            raise KeyError(f"no knob line for {name}")
        if str(value) not in known[name][1]:
            raise ValueError(f"{name}={value} is not among its choices {known[name][1]}")
        text = re.sub(rf"^{name} = \S+(?=  # evoattn:)", f"{name} = {value}", text,
                      count=1, flags=re.MULTILINE)
    return text


def load_seed(case: dict[str, Any], workdir: Path, index: int, device: str = "cpu") -> Any:
    """Imports a (possibly rewritten) copy of the case's seed program as a fresh module: its
    files in a directory of their own, knob values set as the mutator sets them (by key), and,
    on a GPU, its CUDA companions built and handed over as the evaluator does."""
    from evoattn.contract import program, runtime
    from evoattn.contract.knobs import find_knobs, set_knobs as set_program_knobs
    from evoattn.child.loader import build_companions
    main = SEEDS_DIR / f"{case['seed']}.py"
    text = program.read(main)
    knobs = {k.key: k for k in find_knobs(text)}
    values = {name: str(value) for name, value in case.get("knobs", {}).items()}
    for name, value in values.items():
        if name not in knobs:
            raise KeyError(f"no knob {name}")
        if value not in knobs[name].choices:
            raise ValueError(f"{name}={value} is not among its choices {knobs[name].choices}")
    text = set_program_knobs(text, values)
    for old, new in case.get("mutations", [case["mutation"]] if "mutation" in case else []):
        if text.count(old) != 1:
            raise ValueError(f"mutation target {old!r} found {text.count(old)} times")
        text = text.replace(old, new)
    folder = workdir / f"seed_{index}"
    folder.mkdir()
    path = program.write(text, folder, main.name)
    libraries: dict[str, str] = {}
    if device == "cuda":
        import torch
        major, minor = torch.cuda.get_device_capability()
        libraries = build_companions(path, path.read_text(), workdir / "cache", 600,
                                     runtime.detect_arch(), f"sm{major}{minor}")[0]
    spec = importlib.util.spec_from_file_location(f"seed_{index}", path)
    module = importlib.util.module_from_spec(spec)
    module.EVOATTN_LIBRARIES = libraries
    spec.loader.exec_module(module)
    return module


def run_case(case: dict[str, Any], device: str, workdir: Path, index: int) -> dict[str, Any]:
    """Runs one case; returns its error against float64 and whether it is within tolerance.

    On a GPU the public entry is called twice, on fresh inputs of the same shape: the second
    call takes a seed's prepared launch (flash_triton's per-shape cache), the first does not."""
    import torch
    B, H, S, D = case["shape"]
    dtype = getattr(torch, case["dtype"])
    gen = torch.Generator().manual_seed(1000 + index)
    scale = case.get("scale")
    causal = case["causal"]
    result: dict[str, Any] = {"case": case, "ok": False}
    t0 = time.perf_counter()
    calls = 2 if device == "cuda" and case.get("path") != "tma" else 1
    errs = []
    try:
        module = load_seed(case, workdir, index, device)
    except Exception as exc:  # a failure is a result here; the test decides if it is allowed
        result["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return result
    recorder = _Recorder.install(module) if case.get("record") else None
    if case.get("route"):             # the hybrid's other kernel may not run this case
        _forbid(module, "_cuda_call" if case["route"] == "triton" else "_triton")
    if case.get("route") == "cuda":   # ... and the strided CUDA entry records what it gets
        recorder = _EntryRecorder.install(module)
    for _ in range(calls):
        q, k, v = (make_input(case, heads, gen, dtype, device)
                   for heads in (H, case.get("kv_heads", H), case.get("kv_heads", H)))
        before = [t.clone() for t in (q, k, v)]
        try:
            if case.get("path") == "tma":   # the TMA kernel, forced (the public entry uses it on sm_90+)
                out = module._forward(q, k, v, causal, scale if scale is not None else D ** -0.5,
                                      use_tma=True, warp_specialize=False)
            else:
                out = module.attention(q, k, v, causal=causal, scale=scale)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # a failure is a result here; the test decides if it is allowed
            result["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            return result
        problems = []
        if type(out) is not torch.Tensor:
            problems.append(f"returned {type(out).__name__}")
        elif out.shape != q.shape or out.dtype != dtype or out.device != q.device:
            problems.append(f"returned {tuple(out.shape)} {out.dtype} on {out.device}")
        elif any(out.data_ptr() == t.data_ptr() for t in (q, k, v)):
            problems.append("output aliases an input")
        if any(not torch.equal(a, b) for a, b in zip(before, (q, k, v))):
            problems.append("modified its inputs")
        if problems:
            result["error"] = "; ".join(problems)
            return result
        ref = reference(q, k, v, causal, scale)
        errs.append((out.detach().cpu().double() - ref).abs().max().item())
        if recorder is not None:     # the inputs as they were, against what the launch got
            result["given"] = [t.data_ptr() for t in (q, k, v)]
            result["launched"] = recorder.pointers[-1]
    result["seconds"] = time.perf_counter() - t0
    err = max(errs)
    tol = TOLERANCE[case["dtype"]]
    result.update(max_abs_err=err, tolerance=tol, ok=math.isfinite(err) and err <= tol)
    return result


def make_input(case: dict[str, Any], heads: int, gen: Any, dtype: Any, device: str) -> Any:
    """Returns a random (B, heads, S, D) input in the case's layout: "bhsd" (contiguous) or
    "bshd" (contiguous (B, S, H, D) storage viewed as (B, H, S, D), as transformers passes)."""
    import torch
    B, _, S, D = case["shape"]
    t = torch.randn(B, heads, S, D, generator=gen).to(dtype).to(device)
    if case.get("layout", "bhsd") == "bshd":
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
    return t


class _Recorder:
    """Stands in for a seed's Triton kernel `_attn_fwd`: records the data pointers of the q,
    k, v its launches receive (a descriptor's base for TMA), then launches the real kernel."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.pointers = kernel, []

    @classmethod
    def install(cls, module: Any) -> "_Recorder":
        target = getattr(module, "_triton", module)      # the hybrid's Triton companion
        recorder = cls(target._attn_fwd)
        target._attn_fwd = recorder
        return recorder

    def __getitem__(self, grid: Any) -> Any:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            self.pointers.append([getattr(a, "base", a).data_ptr() for a in args[:3]])
            return launch(*args, **kwargs)
        return run


class _EntryRecorder:
    """Wraps a hybrid seed's strided CUDA entry: records the q, k, v addresses of each call."""

    def __init__(self, find: Any) -> None:
        self.find, self.pointers = find, []

    @classmethod
    def install(cls, module: Any) -> "_EntryRecorder":
        recorder = cls(module._strided_entry)
        module._strided_entry = recorder.entry
        return recorder

    def entry(self, device: Any, head_dim: int) -> Any:
        fn = self.find(device, head_dim)

        def run(*args: Any) -> Any:
            self.pointers.append(list(args[:3]))
            return fn(*args)
        return None if fn is None else run


def _forbid(module: Any, name: str) -> None:
    """Makes a hybrid seed's Triton kernel (name "_triton") or its CUDA call ("_cuda_call")
    raise when called, so a case routed the other way fails."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"routed to {name}")
    if name == "_triton":
        module._triton.attention = module._triton.prepare = refuse
    else:
        assert hasattr(module, name), name
        setattr(module, name, refuse)


def reference(q: Any, k: Any, v: Any, causal: bool, scale: float | None) -> Any:
    """Returns attention in float64 on the CPU from the (rounded) inputs the candidate saw
    (k, v with fewer heads serve H // Hkv consecutive query heads each)."""
    import torch
    q, k, v = (t.detach().cpu().double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    S, D = q.shape[-2], q.shape[-1]
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1.0 / math.sqrt(D))
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def child_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="Runs seed test cases (JSON) and writes results.")
    parser.add_argument("cases", type=Path)
    parser.add_argument("results", type=Path)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    cases = json.loads(args.cases.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_case(c, args.device, Path(tmp), i) for i, c in enumerate(cases)]
    args.results.write_text(json.dumps(results))


# ---- parent side --------------------------------------------------------------------
def run_cases(cases: list[dict[str, Any]], device: str = "cpu", timeout_s: float = 300) -> list[dict]:
    """Runs cases in a child process (interpreted on CPU) and returns their results in order."""
    env = dict(os.environ)       # the child runs this file by path: the repo root is not on it
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, results_path = Path(tmp, "cases.json"), Path(tmp, "results.json")
        cases_path.write_text(json.dumps(cases))
        proc = subprocess.run([sys.executable, __file__, str(cases_path), str(results_path),
                               "--device", device],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not results_path.exists():
            raise AssertionError(f"child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(results_path.read_text())


def describe(result: dict[str, Any]) -> str:
    c = result["case"]
    what = (f"{c['seed']} {c.get('knobs', {})} {c.get('path', 'public')} {tuple(c['shape'])} "
            f"{c.get('layout', 'bhsd')} kv_heads={c.get('kv_heads', c['shape'][1])} "
            f"{c['dtype']} causal={c['causal']} scale={c.get('scale')}")
    if "error" in result:
        return f"{what}: {result['error']}"
    return f"{what}: err {result['max_abs_err']:.2e} (tol {result['tolerance']:.0e})"


def assert_all_pass(results: list[dict[str, Any]]) -> None:
    bad = [describe(r) for r in results if not r["ok"]]
    assert not bad, f"{len(bad)} of {len(results)} cases failed:\n" + "\n".join(bad)


def case(seed: str, shape: tuple[int, ...], dtype: str, causal: bool, scale: float | None = None,
         **extra: Any) -> dict[str, Any]:
    return {"seed": seed, "shape": list(shape), "dtype": dtype, "causal": causal,
            "scale": scale, **extra}


def contract_cases(seed: str) -> list[dict[str, Any]]:
    """The shapes the brief names: the CPU benchmark shape, odd tails, D=128, every dtype."""
    out = [case(seed, (1, 2, 128, 64), "float16", c) for c in (False, True)]
    for (S, D), dtype, causal in itertools.product([(77, 64), (33, 128)],
                                                   ["bfloat16", "float32"], [False, True]):
        out.append(case(seed, (1, 2, S, D), dtype, causal, scale=0.3))
    out.append(case(seed, (2, 1, 77, 128), "float16", True, scale=-0.2))   # negative scale
    out.append(case(seed, (1, 1, 1, 64), "float32", False))                # S = 1
    out.append(case(seed, (1, 1, 1, 128), "float16", True))
    return out


def knob_cases(knobs: dict[str, Any], path: str = "public") -> list[dict[str, Any]]:
    """A small, sensitive set of cases for one knob setting: odd S, both D, causal or not."""
    return [case("flash_triton", (1, 2, 77, 64), "float32", True, knobs=knobs, path=path),
            case("flash_triton", (1, 2, 77, 64), "float32", False, 0.3, knobs=knobs, path=path),
            case("flash_triton", (1, 1, 130, 128), "float32", True, knobs=knobs, path=path),
            case("flash_triton", (1, 1, 128, 64), "float16", True, knobs=knobs, path=path)]


# Settings that change what the interpreter computes (warps, stages, TMA and warp
# specialisation do not change it on CPU; the TMA kernel is covered by path="tma").
KNOB_COMBINATIONS = [   # BLOCK_M_D* tiles serve non-causal calls, BLOCK_M_D*_CAUSAL causal ones
    {},
    {"BLOCK_M_D64": 32, "BLOCK_N_D64": 64, "BLOCK_M_D128": 32, "BLOCK_N_D128": 128,
     "BLOCK_M_D64_CAUSAL": 32, "BLOCK_M_D128_CAUSAL": 32},
    {"BLOCK_M_D64": 128, "BLOCK_N_D64": 32, "CAUSAL_SPLIT": False, "BLOCK_M_D64_CAUSAL": 128},
    {"BLOCK_M_D64": 256, "BLOCK_N_D64": 128, "BLOCK_M_D128": 256, "BLOCK_N_D128": 32,
     "BLOCK_M_D64_CAUSAL": 256, "BLOCK_M_D128_CAUSAL": 256},
    {"USE_EXP2": False, "BLOCK_M_D128": 64, "BLOCK_N_D128": 128, "BLOCK_M_D128_CAUSAL": 128},
    {"USE_EXP2": False, "CAUSAL_SPLIT": False, "BLOCK_N_D64": 32},
    {"PERSISTENT": True, "PROGRAMS_PER_SM": 1, "HEAD_MAJOR": False, "CAUSAL_HEAVY_FIRST": False},
    {"PERSISTENT": True, "BLOCK_M_D64": 32, "BLOCK_M_D128": 32, "CAUSAL_SPLIT": False,
     "BLOCK_M_D64_CAUSAL": 32, "BLOCK_M_D128_CAUSAL": 32},
    {"HEAD_MAJOR": False, "CAUSAL_HEAVY_FIRST": True, "BLOCK_N_D64": 128},
    {"CAUSAL_SPLIT": True, "BLOCK_M_D64_CAUSAL": 32, "NUM_STAGES_D64_CAUSAL": 2,
     "BLOCK_M_D128_CAUSAL": 128, "PERSISTENT": True},
]


@pytest.mark.slow
def test_naive_torch_matches_float64_reference():
    assert_all_pass(run_cases(contract_cases("naive_torch")))


@pytest.mark.slow
def test_flash_triton_matches_float64_reference_in_interpreter():
    assert_all_pass(run_cases(contract_cases("flash_triton")))


@pytest.mark.slow
def test_flash_triton_knob_combinations_stay_correct():
    cases = [c for knobs in KNOB_COMBINATIONS for c in knob_cases(knobs)]
    # The TMA kernel (3-D descriptors, clipped stores) through the interpreter, forced.
    cases += [c for knobs in KNOB_COMBINATIONS[:4] + KNOB_COMBINATIONS[6:7]
              for c in knob_cases(knobs, path="tma")]
    # a long sequence takes the long-sequence key tile
    long_knobs = {"LONG_SEQ": 1024, "BLOCK_N_D64_LONG": 128, "BLOCK_M_D64": 32,
                  "BLOCK_M_D64_CAUSAL": 32, "CAUSAL_SPLIT": True}
    cases += [case("flash_triton", (1, 1, 1100, 64), "float32", c, 0.3, knobs=long_knobs)
              for c in (False, True)]
    cases.append(case("flash_triton", (1, 2, 33, 128), "bfloat16", True, 0.3, path="tma"))
    assert_all_pass(run_cases(cases))


@pytest.mark.slow
def test_flash_hybrid_runs_the_triton_kernel_in_the_interpreter():
    """On the CPU every call of the hybrid seed takes its Triton kernel, CUDA_* knobs or not."""
    cases = [case("flash_hybrid", (1, 2, 77, 128), "bfloat16", True, 0.3),
             case("flash_hybrid", (1, 2, 128, 64), "float16", False),
             case("flash_hybrid", (1, 1, 33, 64), "float16", True,
                  knobs={"CUDA_D64": True, "CUDA_D64_CAUSAL": True})]
    assert_all_pass(run_cases(cases))


@pytest.mark.slow
def test_model_layouts_and_gqa_reach_the_triton_launch_without_a_copy():
    """transformers' (B, S, H, D) storage viewed as (B, H, S, D), and k, v with fewer heads
    than q, are launched as they lie (the launch gets the callers' data pointers) and match a
    float64 reference, in each dtype, on the pointer and the TMA path, and through the hybrid."""
    cases = [case("flash_triton", (2, 4, 37, 64), dtype, causal, 0.3, layout=layout,
                  kv_heads=kv, record=True, path=path)
             for dtype, causal, layout, kv, path in [
                 ("float32", True, "bshd", 4, "public"), ("float16", False, "bshd", 2, "public"),
                 ("bfloat16", True, "bshd", 1, "public"), ("bfloat16", False, "bhsd", 2, "tma"),
                 ("float16", True, "bshd", 2, "tma"), ("float32", False, "bshd", 2, "tma")]]
    cases.append(case("flash_hybrid", (1, 4, 33, 128), "bfloat16", True, layout="bshd",
                      kv_heads=2, record=True))
    results = run_cases(cases)
    assert_all_pass(results)
    for r in results:
        assert r["launched"] == r["given"], describe(r)


@pytest.mark.slow
def test_checks_catch_broken_masks():
    """The harness above can fail: an off-by-one causal mask and a key-tail mask one too wide."""
    mutations = [("keep = keep & (cols[None, :] <= offs_m[:, None])",
                  "keep = keep & (cols[None, :] < offs_m[:, None] + 2)"),
                 ("keep = cols[None, :] < S", "keep = cols[None, :] < S + 1")]
    cases = [case("flash_triton", (1, 2, 77, 64), "float32", True, mutation=list(mutations[0])),
             case("flash_triton", (1, 2, 77, 64), "float32", False, mutation=list(mutations[1]))]
    results = run_cases(cases)
    passed = [describe(r) for r in results if r["ok"] or "error" in r]
    assert not passed, "a broken kernel passed (or crashed instead of computing):\n" + "\n".join(passed)


def test_every_flash_knob_value_is_one_of_its_choices():
    known = knob_values((SEEDS_DIR / "flash_triton.py").read_text())
    assert {"BLOCK_M_D64", "BLOCK_N_D128", "CAUSAL_SPLIT", "USE_EXP2", "USE_TMA",
            "WARP_SPECIALIZE", "PERSISTENT"} <= set(known)
    for name, (value, choices) in known.items():
        assert value in choices, f"{name} = {value} not in {choices}"


def _load_with_knobs(tmp_path, seed: Path, knobs: dict[str, Any], name: str):
    """Imports a copy of `seed` with the knobs set; every value must differ from the seed's
    default, so an assertion on it fails if the code ignores the knob."""
    defaults = {m["name"]: m["value"] for m in KNOB_LINE.finditer(seed.read_text())}
    same = [k for k, v in knobs.items() if str(v) == defaults[k]]
    assert not same, f"test values equal the seed's defaults: {same}"
    path = tmp_path / f"{name}.py"
    path.write_text(set_knobs(seed.read_text(), knobs))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tile_settings_follow_the_causal_and_long_sequence_knobs(tmp_path):
    knobs = {"BLOCK_M_D64": 128, "BLOCK_N_D64": 32, "NUM_STAGES_D64": 3, "BLOCK_M_D64_CAUSAL": 32,
             "NUM_STAGES_D64_CAUSAL": 4, "LONG_SEQ": 4096, "BLOCK_N_D64_LONG": 64,
             "BLOCK_M_D128": 64, "BLOCK_N_D128": 32, "NUM_STAGES_D128": 4,
             "BLOCK_M_D128_CAUSAL": 256, "NUM_STAGES_D128_CAUSAL": 1, "BLOCK_N_D128_LONG": 128,
             "NUM_STAGES_SMALL_GRID": 5, "BLOCK_N_D64_SMALL_GRID": 64}
    mod = _load_with_knobs(tmp_path, SEEDS_DIR / "flash_triton.py", knobs, "flash_knobs_seed")
    warps = mod.NUM_WARPS_D64
    assert mod._settings(64, False, 4095) == (128, 32, warps, 3)
    assert mod._settings(64, False, 4096) == (128, 64, warps, 3)
    assert mod._settings(64, True, 100) == (32, 32, warps, 4)
    assert mod._settings(64, True, 4096) == (32, 64, warps, 4)
    assert mod._settings(128, False, 100) == (64, 32, mod.NUM_WARPS_D128, 4)
    assert mod._settings(128, True, 4096) == (256, 128, mod.NUM_WARPS_D128, 1)
    # one wave (at most one program per SM, not persistent): the small-grid depth, and at D=64
    # the small-grid key tile. S=100 with 128-row tiles is one item per head.
    assert mod._launch_settings(64, False, 100, 132, 132) == (128, 64, warps, 5)
    assert mod._launch_settings(64, False, 100, 133, 132) == (128, 32, warps, 3)
    assert mod._launch_settings(64, False, 4096, 4, 132) == (128, 64, warps, 5)   # 32 items
    assert mod._launch_settings(128, False, 100, 66, 132) == (64, 32, mod.NUM_WARPS_D128, 5)
    persistent = _load_with_knobs(tmp_path, SEEDS_DIR / "flash_triton.py",
                                  {**knobs, "PERSISTENT": True}, "flash_knobs_persistent")
    assert persistent._launch_settings(64, False, 100, 8, 132) == (128, 32, warps, 3)


def test_gqa_tile_settings_follow_the_causal_and_long_sequence_knobs(tmp_path):
    knobs = {"BLOCK_M_D64": 128, "BLOCK_N_D64": 32, "NUM_STAGES_D64": 4, "BLOCK_M_D64_CAUSAL": 32,
             "NUM_STAGES_D64_CAUSAL": 1, "LONG_SEQ": 8192, "BLOCK_N_D64_LONG": 64,
             "BLOCK_M_D128": 256, "BLOCK_N_D128": 128, "NUM_STAGES_D128": 5,
             "BLOCK_M_D128_CAUSAL": 32, "NUM_STAGES_D128_CAUSAL": 2, "BLOCK_N_D128_LONG": 32}
    mod = _load_with_knobs(tmp_path, SEEDS_DIR.parent / "gqa" / "gqa_triton.py", knobs,
                           "gqa_knobs_seed")
    assert mod._settings(64, False, 8191) == (128, 32, mod.NUM_WARPS_D64, 4)
    assert mod._settings(64, False, 8192) == (128, 64, mod.NUM_WARPS_D64, 4)
    assert mod._settings(64, True, 77) == (32, 32, mod.NUM_WARPS_D64, 1)
    assert mod._settings(128, False, 100) == (256, 128, mod.NUM_WARPS_D128, 5)
    assert mod._settings(128, True, 8192) == (32, 32, mod.NUM_WARPS_D128, 2)


def test_set_knobs_rewrites_only_the_value_and_rejects_unknown_values():
    text = "BLOCK_M_D64 = 64  # evoattn: choice(32, 64, 128)\nX = 1\n"
    assert set_knobs(text, {"BLOCK_M_D64": 32}) == text.replace("= 64 ", "= 32 ")
    with pytest.raises(ValueError):
        set_knobs(text, {"BLOCK_M_D64": 48})
    with pytest.raises(KeyError):
        set_knobs(text, {"X": 2})


def gpu_cases() -> list[dict[str, Any]]:
    """Knob settings that only a Hopper GPU exercises: TMA, warp specialisation, warps, stages."""
    settings = [{}, {"USE_TMA": False}, {"USE_TMA": True, "PERSISTENT": True},
                {"NUM_STAGES_D64": 1, "NUM_WARPS_D64": 8, "NUM_STAGES_D128": 4,
                 "NUM_WARPS_D128": 4, "BLOCK_M_D128": 64},
                {"BLOCK_M_D64": 128, "BLOCK_N_D64": 128, "NUM_WARPS_D64": 8,
                 "BLOCK_M_D128": 128, "BLOCK_N_D128": 128, "NUM_STAGES_D128": 2},
                {"BLOCK_M_D64": 256, "BLOCK_N_D64": 32, "NUM_WARPS_D64": 8,
                 "BLOCK_M_D128": 256, "BLOCK_N_D128": 32, "NUM_WARPS_D128": 8},
                {"PERSISTENT": True, "PROGRAMS_PER_SM": 1, "HEAD_MAJOR": False},
                {"LONG_SEQ": 1024, "BLOCK_N_D64_LONG": 64, "BLOCK_N_D128_LONG": 128,
                 "BLOCK_M_D64_CAUSAL": 128, "NUM_STAGES_D128_CAUSAL": 2},
                {"WARP_SPECIALIZE": True},
                {"WARP_SPECIALIZE": True, "USE_TMA": False},
                {"FAST_LAUNCH": False}, {"FAST_LAUNCH": False, "USE_TMA": False}]
    shapes = [((2, 3, 1000, 64), "float16"), ((1, 2, 77, 128), "bfloat16"),
              ((1, 2, 300, 64), "float32")]
    return [case("flash_triton", shape, dtype, causal, 0.125, knobs=k)
            for k in settings for shape, dtype in shapes for causal in (False, True)]


@pytest.mark.gpu
def test_flash_triton_gpu_settings_are_correct_or_fail_cleanly():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    results = run_cases(contract_cases("flash_triton") + gpu_cases(), device="cuda", timeout_s=900)
    # The defaults must work everywhere; another setting may also fail cleanly, never compute wrong.
    bad = [describe(r) for r in results
           if not r["ok"] and not (r["case"].get("knobs")
                                   and r.get("error", "").startswith(CLEAN_FAILURES))]
    assert not bad, f"{len(bad)} of {len(results)} cases failed:\n" + "\n".join(bad)
    clean = [describe(r) for r in results if not r["ok"]]
    print(f"{len(clean)} cases failed cleanly:\n" + "\n".join(clean))


def hybrid_gpu_cases() -> list[dict[str, Any]]:
    """The hybrid's two kernels per head dim, the CUDA kernel's persistent path (the default) on
    shapes where a block takes several work items (more items than SMs; each case calls twice,
    so a causal call's second launch reuses its stream's item counter, which the first must have
    put back to 0), and the settings around it: D=64 on the cp.async path and with two consumer
    warpgroups instead of three (non-causal calls head by head, causal ones in sections of 8 MB
    of heads: several, the last one short, on the D=64 shapes), no persistence at D=128 (causal
    calls one head at a time), ping-pong, no overlap (on by default) with half the exponentials
    on the FMA pipe, the TMA-store epilogue (on up to S=4096 by default) switched off, and
    Triton's ordinary launch (FAST_LAUNCH off) against its prepared one. The defaults take the
    causal D=128 heads of (4,16,1000,128) in two sections. Then SPLIT_TAIL_D64's split and merged
    work items."""
    both = {"CUDA_D64": True, "CUDA_D64_CAUSAL": True, "CUDA_D128": True, "CUDA_D128_CAUSAL": True}
    settings = [{},
                {"CUDA_D128": False, "CUDA_D128_CAUSAL": False},
                both,
                {**both, "PERSISTENT_D64": 0, "WARP_SPECIALIZE_D64": 0,
                 "wgmma_flash.cu:BLOCK_N_D64": 64},
                {**both, "WIDE_D64": 0, "HEAD_MAJOR_D64": 1, "SECTION_MB_D64": 8},
                {**both, "PERSISTENT_D128": 0, "PINGPONG": 1, "TMA_STORE_MAX_S": 0,
                 "SECTION_MB_D128": 0},
                {**both, "PINGPONG": 1, "OVERLAP_D128": 0, "PERSISTENT_DYNAMIC": 0},
                {**both, "OVERLAP_D128": 0, "TMA_STORE_MAX_S": 1024, "EXP2_POLY_EVERY": 2},
                {"FAST_LAUNCH": False, "CUDA_D128": False}]
    shapes = [((2, 3, 1000, 64), "float16"), ((1, 2, 77, 128), "bfloat16"),
              ((4, 16, 1000, 128), "float16"), ((4, 24, 700, 64), "bfloat16"),
              ((1, 2, 300, 64), "float32"),
              ((1, 4, 1500, 128), "float16"),   # past a TMA_STORE_MAX_S of 1024
              ((1, 2, 4200, 128), "float16"),   # past its default: the st.global epilogue
              ((4, 33, 500, 64), "bfloat16"),   # CUDA_D64_FILL_KEYS's route: 528 items
              ((8, 16, 1000, 64), "float16")]   # 1024 items: several per block
    out = [case("flash_hybrid", shape, dtype, causal, 0.125, knobs=k)
           for k in settings for shape, dtype in shapes for causal in (False, True)]
    # SPLIT_TAIL_D64 on 132 SMs (H100, H200): non-causal D=64 calls whose last wave of work items is
    # taken in 2 or 3 parts of its key tiles (the partial last key tile in one of them) and
    # merged; with the knob at 4, in 4 parts; and not at all (causal calls never split)
    split = [((1, 12, 2719, 64), "float16"), ((1, 12, 2497, 64), "bfloat16"),
             ((1, 12, 2127, 64), "float16")]
    out += [case("flash_hybrid", shape, dtype, causal, 0.125, knobs=k)
            for k in ({}, {"SPLIT_TAIL_D64": 4}, {"SPLIT_TAIL_D64": 0})
            for shape, dtype in split for causal in (False, True)]
    return out


def hybrid_view_cases() -> list[dict[str, Any]]:
    """transformers' (B, S, H, D) views and k, v with fewer heads on the CUDA kernel (Triton
    forbidden; the entry gets the callers' data pointers): both head dims, odd lengths, past
    TMA_STORE_MAX_S (the st.global epilogue at the output's strides), the TMA store off, no
    persistence; and a head dim whose path is not warp-specialised, where they go to Triton
    (the CUDA call forbidden)."""
    both = {"CUDA_D64": True, "CUDA_D64_CAUSAL": True, "CUDA_D128": True, "CUDA_D128_CAUSAL": True}
    cuda = [((2, 8, 1000, 128), "bfloat16", "bshd", 2), ((2, 8, 777, 128), "float16", "bhsd", 2),
            ((1, 4, 4200, 128), "float16", "bshd", 4), ((3, 6, 129, 128), "float16", "bshd", 6),
            ((4, 16, 1000, 64), "float16", "bshd", 4), ((2, 4, 300, 64), "bfloat16", "bshd", 1),
            # SPLIT_TAIL_D64's parts (132 SMs): merged rows stored at the output's strides
            ((1, 12, 2497, 64), "float16", "bshd", 4), ((1, 12, 2719, 64), "bfloat16", "bshd", 3)]
    out = [case("flash_hybrid", shape, dtype, causal, 0.125, layout=layout, kv_heads=kv,
                knobs=knobs, route="cuda")
           for knobs in ({}, both, {**both, "TMA_STORE_MAX_S": 0, "PERSISTENT_D128": 0,
                                    "WIDE_D64": 0})
           for shape, dtype, layout, kv in cuda for causal in (False, True)
           if knobs or shape[-1] == 128 or shape[0] * shape[1] * -(-shape[2] // 128) >= 132]
    out += [case("flash_hybrid", (2, 4, 300, 64), "float16", causal, layout="bshd", kv_heads=2,
                 knobs={**both, "WARP_SPECIALIZE_D64": 0}, route="triton")
            for causal in (False, True)]
    return out


@pytest.mark.gpu
def test_flash_hybrid_gpu_paths_are_correct():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    results = run_cases(contract_cases("flash_hybrid") + hybrid_gpu_cases() + hybrid_view_cases(),
                        device="cuda", timeout_s=900)
    assert_all_pass(results)
    for r in results:
        if r["case"].get("route") == "cuda":
            assert r["launched"] == r["given"], describe(r)


if __name__ == "__main__":
    child_main(sys.argv[1:])
