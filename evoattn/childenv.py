"""What a candidate's child process is given: its environment, limits, cache and GPU.

The environment is an allow-list of the parent's, minus anything that looks secret and the
variables a run names (its LLM key's); the settings say how the parent runs its children.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

_ENV_KEEP = re.compile(r"^(PATH|LD_LIBRARY_PATH|LANG|LC_\w+|CUDA_\w+|NVIDIA_\w+|TRITON_\w+|"
                       r"TORCH_\w+|PYTORCH_\w+|NCCL_\w+|CC|CXX|CUDAHOSTCXX|OMP_NUM_THREADS|"
                       r"MKL_\w+|OPENBLAS_\w+|TERM|VIRTUAL_ENV|CONDA_PREFIX|NVCC_\w+|"
                       r"TORCH_CUDA_ARCH_LIST|MAX_JOBS|TORCH_EXTENSIONS_DIR)$")
_ENV_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE",
                         re.IGNORECASE)
GPU_WAIT_SLACK_S = 10.0   # a turn's end: the kill of a child past its deadline, its exit
SPARES = 2                # spare children a slot keeps (SandboxSettings.spare): one set up,
                          # one setting up while a candidate checks


def child_env(base: dict[str, str], workdir: str, cache_dir: str, device: str,
              extra_secret_names: tuple[str, ...] = ()) -> dict[str, str]:
    """Returns the child's environment: an allow-list of the parent's, minus anything secret."""
    env = {k: v for k, v in base.items()
           if _ENV_KEEP.match(k) and not _ENV_SECRET.search(k) and k not in extra_secret_names}
    repo_root = str(Path(__file__).resolve().parent.parent)
    pythonpath = os.pathsep.join(p for p in [repo_root, base.get("PYTHONPATH", "")] if p)
    env.update(HOME=workdir, TMPDIR=workdir, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1",
               PYTHONDONTWRITEBYTECODE="1", TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"),
               TORCH_EXTENSIONS_DIR=os.path.join(cache_dir, "torch_ext"),
               TORCHINDUCTOR_COMPILE_THREADS="1")   # compiles in-process, no worker pool
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


@dataclasses.dataclass(frozen=True)
class SandboxSettings:
    """How the parent runs children: limits, the cache, which GPU, what never reaches them."""

    cache_dir: str = ""                        # "" = $EVOATTN_CACHE or ~/.cache/evoattn
    max_host_mem_bytes: int = 32 * 2 ** 30
    visible_device: str | None = None          # the child's CUDA_VISIBLE_DEVICES (one GPU)
    secret_env_names: tuple[str, ...] = ()     # e.g. the LLM key's variable
    # Fork candidates from a warm zygote (torch imported once); EVOATTN_ZYGOTE=0 turns it off.
    zygote: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("EVOATTN_ZYGOTE", "1") != "0")
    # A run's station (evoattn/station.py) times the baselines once for every candidate,
    # again when its times are older than station_refresh_s; None: each child times them.
    station_refresh_s: float | None = None
    # Evaluations sharing visible_device (a run's `evaluator.per_gpu`): their children take
    # turns on it through a lock file in the cache (gpu_lock_path).
    gpu_share: int = 1
    # The CPUs the children's timing picks its CPU from (evoattn/child/cpu_pin.py); empty: any
    # of theirs. A machine's GPUs get disjoint blocks.
    timing_cpus: tuple[int, ...] = ()
    # Keep spare children (SPARES), forked from the zygote, that set up the next candidates'
    # evaluations (CUDA, the baselines' plans, inputs and references) while one is evaluated;
    # a set-up never overlaps another evaluation's timing (a GPU lock, evoattn/child/gpu_turn.py).
    # A run's slots on a GPU keep them; without the zygote or with a station, none is kept.
    spare: bool = False
    # The run deadline calibrate() derives from the seed's evaluation: run_factor × its run
    # stages, at least run_floor_s (sandbox.run_deadline); None: the request's stays.
    run_factor: float | None = None
    run_floor_s: float = 0.0

    def gpu_wait_s(self, run_timeout_s: float) -> float:
        """How long a child may wait for its turn: each other sharer's turn (its run stage,
        after which its parent kills it) and some slack."""
        return max(1, self.gpu_share - 1) * (run_timeout_s + GPU_WAIT_SLACK_S)


def gpu_lock_path(cache_dir: str, device: str) -> str:
    """Returns the file that the children sharing one GPU lock to take turns on it (named by
    the GPU's id as the orchestrator sees it: runs on one machine with one cache share it)."""
    return os.path.join(cache_dir, "gpu-locks", f"gpu-{device}.lock")


def default_cache_dir() -> str:
    """Returns the build/Triton cache directory ($EVOATTN_CACHE or ~/.cache/evoattn)."""
    return os.environ.get("EVOATTN_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "evoattn")


def detect_target(device: str) -> str | None:
    """The run's `@target` fact for knob conditions: "cpu", or "smXY" from the visible GPUs'
    compute capability (nvidia-smi, so CUDA is not initialised here) when they all agree;
    None when that cannot be told (the mutator then rules nothing out)."""
    if device == "cpu":
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    caps = {c.strip() for c in out.splitlines() if re.fullmatch(r"\d+\.\d+", c.strip())}
    return "sm" + caps.pop().replace(".", "") if len(caps) == 1 else None
