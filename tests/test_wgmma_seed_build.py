"""The wgmma seed without a GPU: the probe's knob settings, and an nvcc build for sm_90a.

nvcc compiles for Hopper on a machine without one; ptxas's report shows register spills and
serialised wgmma (C7510-C7520, reported as info) before any GPU time is spent, and the SASS of the
built library (cuobjdump, from the CUDA toolkit or Triton's wheel) shows which element type
each instantiation's tensor-core instructions and conversions use.
"""
from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from evoattn.contract.runtime import perf_notes
from evoattn.mutators.knobs import find_knobs

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "seeds" / "sdpa" / "wgmma_flash.cu"


def _probe_module():
    from benchmarks import wgmma_probe
    return wgmma_probe


def test_probe_builds_every_structural_combination_and_every_knob_value():
    probe = _probe_module()
    knobs = find_knobs(SEED.read_text())
    settings = probe.probe_settings(knobs)
    keys = [json.dumps(s, sort_keys=True) for s in settings]
    assert len(keys) == len(set(keys)), "a setting is built twice"
    structural = [k for k in knobs if k.name in probe.STRUCTURAL]
    assert len(structural) == len(probe.STRUCTURAL), "a structural knob is missing from the seed"
    for combo in itertools.product(*(k.choices for k in structural)):
        want = dict(zip((k.name for k in structural), combo))
        assert any(all(s[n] == v for n, v in want.items()) for s in settings), want
    for k in knobs:
        for v in k.choices:
            assert any(s[k.name] == v for s in settings), (k.name, v)
    # persistence changes only the warp-specialised path: it must run there at both head dims,
    # with several items per block (more items than SMs in some shape), and with ping-pong
    for d in (64, 128):
        assert any(s[f"PERSISTENT_D{d}"] == "1" and s[f"WARP_SPECIALIZE_D{d}"] == "1" and
                   s["PINGPONG"] == "1" for s in settings), d
        assert any(D == d and B * H * -(-S // 128) > 132 for B, H, S, D, _ in probe.SDPA_SHAPES), d


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_probe_knows_which_ring_depths_fit_in_shared_memory(tmp_path):
    """The probe asks the built library (the seed's WsSmem) for its shared memory: host code,
    so the check runs without a GPU (PTX-only builds, no ptxas)."""
    import concurrent.futures
    probe = _probe_module()
    source = SEED.read_text()
    base = {"WARP_SPECIALIZE_D64": "1", "WARP_SPECIALIZE_D128": "1", "NUM_WARPGROUPS": "2",
            "BLOCK_N_D64": "128", "BLOCK_N_D128": "128", "TMA_STORE_MAX_S": "0",
            "Q_DOUBLE_MAX_S_D64": "0", "Q_DOUBLE_MAX_S_D128": "0"}
    cases = [  # (knobs, D, fits)
        # D=128, 128-key tiles: q 32 KB + 64 KB per stage; 3 stages fit in 227 KB, 4 do not
        ({**base, "WS_STAGES_D128": "3"}, 128, True),
        ({**base, "WS_STAGES_D128": "4"}, 128, False),
        # D=64 with three consumer warpgroups: q 24 KB + 32 KB per stage; 4 fit
        ({**base, "WS_STAGES_D64": "4"}, 64, True),
        ({**base, "WS_STAGES_D128": "4", "BLOCK_N_D128": "64"}, 128, True),
        # the TMA-store epilogue adds a 32 KB output tile: 2 stages still fit, 3 no longer do
        ({**base, "WS_STAGES_D128": "2", "TMA_STORE_MAX_S": "1024"}, 128, True),
        ({**base, "WS_STAGES_D128": "3", "TMA_STORE_MAX_S": "1024"}, 128, False),
        # the cp.async path has its own fixed ring: never refused
        ({**base, "WS_STAGES_D128": "4", "WARP_SPECIALIZE_D128": "0"}, 128, True),
        # a second q tile (32 KB) with the output tile: 2 stages fit (the seed's), 3 without
        # the output tile do not
        ({**base, "WS_STAGES_D128": "2", "TMA_STORE_MAX_S": "1024",
          "Q_DOUBLE_MAX_S_D128": "1024"}, 128, True),
        ({**base, "WS_STAGES_D128": "3", "Q_DOUBLE_MAX_S_D128": "1024"}, 128, False),
    ]

    def build(i: int):
        seed = tmp_path / f"seed_{i}.cu"
        seed.write_text(probe.set_knobs(source, cases[i][0]))
        so = tmp_path / f"probe_{i}.so"
        proc = subprocess.run(
            ["nvcc", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
             "-gencode=arch=compute_90a,code=compute_90a", f'-DWGF_SEED="{seed}"',
             f"-I{SEED.parent}",        # the seed's companion header
             "-DWGF_PROBE_UNITS=0", "-o", str(so), str(probe.PROBE)],
            capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return probe.load(so)

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        libs = list(ex.map(build, range(len(cases))))
    for (vals, d, fits), lib in zip(cases, libs):
        assert probe.fits_shared_memory(lib, vals, d) is fits, (vals, d)
    # the byte count is the documented layout: the q tiles, the k/v stages, the output tile, then
    # the mbarriers (full/empty per q tile, four per stage), an item slot per q tile, and the
    # alignment slack
    tile = 128 * 128 * 2
    assert libs[4].probe_ws_smem_bytes(128) == tile + 2 * 2 * tile + tile + 8 * (2 + 4 * 2) + 8 + 1024
    assert libs[7].probe_ws_smem_bytes(128) == \
        2 * tile + 2 * 2 * tile + tile + 8 * (4 + 4 * 2) + 16 + 1024


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_the_last_wave_split_plan_and_its_parts_tile_every_key_once(tmp_path):
    """SPLIT_TAIL_D64 as the seed's host code plans it (the probe library, PTX-only: no GPU):
    on 132 SMs a last wave that fills at most half of them is split into as many parts as the
    grid holds, up to the knob and the key tiles; and the kernel's parts of an item cover its
    key tiles once, in order, each with at least one."""
    probe = _probe_module()
    libs = {}
    for knob in ("3", "4", "0"):
        seed = tmp_path / f"seed_{knob}.cu"
        seed.write_text(probe.set_knobs(SEED.read_text(), {"SPLIT_TAIL_D64": knob}))
        so = tmp_path / f"probe_{knob}.so"
        proc = subprocess.run(
            ["nvcc", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
             "-gencode=arch=compute_90a,code=compute_90a", f'-DWGF_SEED="{seed}"',
             f"-I{SEED.parent}", "-DWGF_PROBE_UNITS=0", "-o", str(so), str(probe.PROBE)],
            capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        libs[knob] = probe.load(so)

    def parts(knob: str, B: int, H: int, S: int) -> int:
        items = B * H * -(-S // 192)          # three consumer warpgroups: 192-row items
        return libs[knob].probe_tail_parts(items, min(items, 132), -(-S // 128))

    # the default configs: 704 items end in a wave of 44 (thirds); 768 in one of 108 (none)
    assert [parts("3", *c) for c in [(1, 32, 4096), (2, 32, 2048), (4, 32, 1024), (8, 32, 512)]] \
        == [3, 3, 1, 1]
    assert parts("3", 1, 12, 2719) == 2       # 180 items: a wave of 48, two parts fit
    assert parts("3", 1, 12, 2127) == 3 and parts("4", 1, 12, 2127) == 4   # the knob caps it
    assert parts("3", 1, 8, 512) == 1         # fewer items than SMs: no last wave to split
    assert parts("4", 1, 132, 129) == 1       # a full last wave
    assert libs["3"].probe_tail_parts(140, 132, 2) == 2   # at most the key tiles
    assert parts("0", 1, 32, 4096) == 1       # off
    lib = libs["3"]
    for all_tiles in range(1, 40):
        for n in range(1, min(4, all_tiles) + 1):
            edges = [lib.probe_part_first_tile(p, all_tiles, n) for p in range(n + 1)]
            assert edges[0] == 0 and edges[-1] == all_tiles, (all_tiles, n, edges)
            assert all(b > a for a, b in zip(edges, edges[1:])), (all_tiles, n, edges)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_a_ring_too_deep_for_a_block_fails_the_build_only_where_its_path_is_on(tmp_path):
    """Three stages with the TMA-store tile do not fit at D=128 (a build error naming the knob,
    instead of a failed launch on every GPU call); four fit at D=64; and a ring too deep for
    D=128 builds while D=128 takes the cp.async path (that path is then not instantiated)."""
    probe = _probe_module()
    source = SEED.read_text()
    cases = [({"WS_STAGES_D128": "3", "WARP_SPECIALIZE_D128": "1", "TMA_STORE_MAX_S": "1024"},
              False),
             ({"WS_STAGES_D128": "2", "WARP_SPECIALIZE_D128": "1", "TMA_STORE_MAX_S": "1024",
               "WS_STAGES_D64": "4"}, True),
             ({"WS_STAGES_D128": "4", "WARP_SPECIALIZE_D128": "0", "WARP_SPECIALIZE_D64": "1",
               "BLOCK_N_D64": "128"}, True)]
    for i, (vals, builds) in enumerate(cases):
        seed = tmp_path / f"seed_{i}.cu"
        seed.write_text(probe.set_knobs(source, vals))
        proc = subprocess.run(
            ["nvcc", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
             "-gencode=arch=compute_90a,code=compute_90a", f"-I{SEED.parent}",
             "-o", str(tmp_path / f"seed_{i}.so"), str(seed)],
            capture_output=True, text=True, timeout=600)
        assert (proc.returncode == 0) is builds, (vals, proc.stderr[-2000:])
        if not builds:
            assert "WS_STAGES_D* too deep" in proc.stderr


class SeedBuild(NamedTuple):
    library: Path
    log: str                                  # nvcc's output with ptxas -v


# Each head dim instantiates only the path its WARP_SPECIALIZE_D* takes: the seed's setting and
# the swapped one between them build both kernels at both head dims.
SWAPPED = {"WARP_SPECIALIZE_D64": "0", "WARP_SPECIALIZE_D128": "0"}


@pytest.fixture(scope="module")
def seed_builds(tmp_path_factory) -> list[SeedBuild]:
    """The seed at its knob setting and with its paths swapped, built once each with the
    evaluator's own nvcc flags."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    import concurrent.futures
    from evoattn.contract.runtime import fast_flags
    knobs = {k.name: k.value for k in find_knobs(SEED.read_text())}
    assert {n: knobs[n] for n in SWAPPED} == {"WARP_SPECIALIZE_D64": "1",
                                              "WARP_SPECIALIZE_D128": "1"}, "the seed's paths moved"
    work = tmp_path_factory.mktemp("wgmma_seed")
    swapped = work / "swapped.cu"
    swapped.write_text(_probe_module().set_knobs(SEED.read_text(), SWAPPED))

    def build(src: Path) -> SeedBuild:
        lib = work / (src.stem + ".so")
        proc = subprocess.run(["nvcc", *fast_flags("sm_90a"), "-Xptxas", "-v", f"-I{SEED.parent}",
                               "-o", str(lib), str(src)], capture_output=True, text=True,
                              timeout=600)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-3000:]
        return SeedBuild(lib, log)

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        return list(ex.map(build, [SEED, swapped]))


def test_seed_builds_for_sm90a_without_spills_or_serialised_wgmma(seed_builds):
    names = []
    # 2 dtypes x 2 head dims, one path each; the seed's warp-specialised kernels once per
    # count of q tiles (Q_DOUBLE_MAX_S_D*: one or two)
    for build, kernels in zip(seed_builds, (8, 4)):
        log = build.log
        assert "warning" not in log.lower(), log[-3000:]
        # ptxas reports serialised wgmma and the waits it injected (C75xx) as "info"
        assert not perf_notes(log), perf_notes(log)
        # per tensor-core kernel (wgmma_flash, wgmma_ws): "N bytes spill stores" must be 0
        blocks = re.findall(r"Compiling entry function '(\w*wgmma_(?:flash|ws)_kernel\w*)'.*?"
                            r"(\d+) bytes spill stores", log, re.S)
        assert len(blocks) == kernels, log[-3000:]
        assert all(n == "0" for _, n in blocks), blocks
        names += [n for n, _ in blocks]
    assert len(set(names)) == 12


def _cuobjdump() -> str | None:
    """cuobjdump from PATH, else the copy Triton's NVIDIA backend ships."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.is_file() else None


def _sass_opcodes(library: Path) -> dict[str, list[str]]:
    """{mangled kernel name: its SASS opcodes (with modifiers), in order}."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton's wheel)")
    proc = subprocess.run([tool, "-sass", str(library)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kernels: dict[str, list[str]] = {}
    ops: list[str] = []
    for line in proc.stdout.splitlines():
        head = re.search(r"Function : (\S+)", line)
        if head:
            ops = kernels.setdefault(head.group(1), [])
            continue
        # "/*0af0*/  @!P0 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ... ;"
        ins = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Za-z0-9_.]*)", line)
        if ins:
            ops.append(ins.group(1))
    return kernels


def test_bfloat16_instantiations_run_bf16_wgmma_and_round_to_bf16(seed_builds):
    """Each tensor-core kernel exists for __half and __nv_bfloat16: the bf16 one issues every
    wgmma as .bf16 (HGMMA...BF16) and rounds P and O with bf16 conversions, the fp16 one uses
    no bf16 instruction; both issue the same number of wgmma (one kernel body, one type)."""
    kernels = {n: o for b in seed_builds for n, o in _sass_opcodes(b.library).items()}
    seen = set()
    for name, ops in kernels.items():
        m = re.fullmatch(r"_Z\d+(wgmma_(?:flash|ws)_kernel)I(13__nv_bfloat16|6__half)Li(\d+)E.*",
                         name)
        if m is None:
            continue
        kernel, elem, d = m.group(1), m.group(2), m.group(3)
        bf16 = elem == "13__nv_bfloat16"
        seen.add((kernel, bf16, d))
        hgmma = [o for o in ops if o.startswith("HGMMA.")]
        packs = [o for o in ops if o.startswith("F2FP.")]
        assert hgmma, name
        # HGMMA.64x{N}x16.F32 is the f16 form; .BF16 the bf16 one (the 64 N / 16 K shape)
        assert all(o.endswith(".BF16") == bf16 for o in hgmma), (name, sorted(set(hgmma)))
        want = "F2FP.BF16.F32.PACK_AB" if bf16 else "F2FP.F16.F32.PACK_AB"
        assert want in packs, (name, sorted(set(packs)))
        assert all(".BF16." in o if bf16 else ".BF16." not in o for o in packs), \
            (name, sorted(set(packs)))
    assert seen == {(k, b, d) for k in ("wgmma_flash_kernel", "wgmma_ws_kernel")
                    for b in (False, True) for d in ("64", "128")}, seen

    def count(name: str) -> int:
        return sum(o.startswith("HGMMA.") for o in kernels[name])
    for name in kernels:
        if re.fullmatch(r"_Z\d+wgmma_(?:flash|ws)_kernelI13__nv_bfloat16.*", name):
            twin = name.replace("I13__nv_bfloat16", "I6__half")
            assert count(name) == count(twin), name


@pytest.mark.parametrize("args, message", [
    (["--set", "NO_SUCH_KNOB=1"], "no such knob"),
    (["--set", "SECTION_MB_D64=7"], "not among its choices"),
    (["--set", "SECTION_MB_D64"], "expected NAME=VALUE"),
    (["--config", "4,16,x"], "expected four positive integers"),
])
def test_ncu_seed_rejects_bad_arguments_with_one_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.ncu_seed", str(SEED), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
