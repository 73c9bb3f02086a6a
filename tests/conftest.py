"""Shared test setup: a per-session build/Triton cache and the `gpu` marker."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("EVOATTN_CACHE", str(Path(os.environ.get("TMPDIR", "/tmp"))
                                               / "evoattn-test-cache"))
    # An exported package builds its C++ call path in the background on its first call; the
    # suite's many short package processes would each start that build. Its own tests
    # (test_native_call.py) turn it on; EVOATTN_NATIVE=1 runs the whole suite through it.
    os.environ.setdefault("EVOATTN_NATIVE", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine: "
                                   "pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
