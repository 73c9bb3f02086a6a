"""The seeds call Triton's C launcher directly only on the Triton versions whose argument layout
they were written against; any other version takes Triton's own launch path.

The launcher is private API: Triton 3.9's takes its arguments in another order and form, so a
seed that handed it 3.6's layout would fail (or worse) on every prepared call. The GPU test
(tests/test_seeds_gpu.py) checks the direct launch itself on the GPU's Triton; here, on any
machine, a stand-in compiled kernel shaped like 3.6's is offered under several versions.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import triton

ROOT = Path(__file__).resolve().parents[1]
SEEDS = {"sdpa": ROOT / "seeds/sdpa/flash_triton.py", "decode": ROOT / "seeds/decode/decode_triton.py"}


def load(name: str):  # noqa: ANN201
    spec = importlib.util.spec_from_file_location(f"raw_{name}", SEEDS[name])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_kernel(name: str) -> SimpleNamespace:
    """A compiled kernel as Triton 3.6 lays one out: for sdpa, run.launch is the Python
    wrapper that encodes TMA descriptors around the C launcher (a closure cell named
    `launcher`); for decode (no descriptors), run.launch is the C launcher itself."""
    c_launcher = len                                      # any builtin: it is never called

    def wrapper(*args):  # noqa: ANN002, ANN202
        return launcher(*args)

    launcher = c_launcher
    run = SimpleNamespace(launch=wrapper if name == "sdpa" else c_launcher,
                          global_scratch_size=0, profile_scratch_size=0,
                          launch_cooperative_grid=False, launch_pdl=False)
    metadata = SimpleNamespace(tensordesc_meta=[{"swizzle": 3}] * 4)
    return SimpleNamespace(run=run, metadata=metadata)


@pytest.mark.parametrize("name", sorted(SEEDS))
@pytest.mark.parametrize("version, direct", [("3.6.0", True), ("3.6.1+git1234", True),
                                             ("3.5.1", False), ("3.9.0", False),
                                             ("3.10.0", False), ("4.0.0", False)])
def test_the_c_launcher_is_used_only_on_the_versions_it_was_written_for(
        name: str, version: str, direct: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    seed = load(name)
    monkeypatch.setattr(triton, "__version__", version)
    raw = seed._raw_launcher(fake_kernel(name))
    assert (raw is not None) == direct
    if direct:
        assert raw[0] is len                              # the C launcher, not the wrapper


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_a_kernel_that_needs_scratch_memory_takes_the_python_path(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seed = load(name)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    kernel = fake_kernel(name)
    kernel.run.global_scratch_size = 128
    assert seed._raw_launcher(kernel) is None
