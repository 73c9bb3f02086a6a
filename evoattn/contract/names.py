"""Names both sides of the process boundary share: dtypes, timing modes, stages, the width.

The orchestrator (config, CLI, reports, the sandbox) and the evaluator's child read these
from here; the exported package's dtype codes live in runtime.py (shipped with it).
"""
from __future__ import annotations

DTYPES = ("float16", "bfloat16", "float32")   # every dtype a config, a flag or a problem may name

TIMING_MODES = ("call", "kernel", "graph")    # evoattn/child/timing.py describes each
MODE_WORDS = {"call": "call time", "kernel": "kernel time", "graph": "graph time"}
MODE_DESCRIPTIONS = {"kernel": "kernel (GPU time of one call, L2 flushed)",
                     "call": "call (back-to-back eager calls, host cost included)",
                     "graph": "graph (replayed from a CUDA graph)"}

# The default target relative half-width (95%) of the fitness ratio's interval: the fitness
# mode's rounds stop once each config's speedup is known this closely.
WIDTH = 0.01


class Stage:
    """The stages a child reports to its parent as it goes (evoattn/child/harness.py); the parent
    sets deadlines and counts time by them (evoattn/sandbox.py)."""

    START = "start"              # the parent's own: launch and imports before the first report
    BUILD = "build"
    BASELINES = "baselines"
    REFERENCE = "reference"
    TIMER = "timer"
    CEILING = "ceiling"
    LOAD = "load"
    CHECK = "check"
    TIME = "time"
    PROFILE = "profile"
    GPU_WAIT = "gpu-wait"        # waiting for its turn on a shared GPU (evoattn/child/gpu_turn.py)
    BUILD_WAIT = "build wait"    # the parent's own: waiting for another candidate's build
