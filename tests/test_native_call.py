"""The exported package's C++ call path (_callkey.cpp through _native.py): built in the
background, it tells apart exactly the calls the Python key tells apart, serves and counts calls
as the Python path does, leaves the Python path in place where it cannot be built, and leaves no
build running when its process exits."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from test_export_package import export_naive

BUILD_WAIT_S = 600

# The C++ path needs a C++ compiler (ninja comes with the test extras); without one, these tests
# say so rather than fail (.ci/run installs g++ where it is missing).
pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None,
    reason="no C++ compiler (c++ or $CXX) to build the package's C++ call path")


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("native")
    exported = export_naive(tmp)
    return {"out": exported["out"], "name": exported["summary"].package,
            "cache": tmp / "kernel-cache"}


def _run(package: dict, code: str, env: dict[str, str] | None = None,
         timeout: int = BUILD_WAIT_S + 120) -> dict:
    """Runs code (with `pkg` and `ops` imported) in a fresh process; returns the JSON it
    prints last."""
    prelude = (f"import json, torch\nimport {package['name']} as pkg\n"
               f"from {package['name']} import ops\n")
    env = {**os.environ, "EVOATTN_KERNEL_CACHE": str(package["cache"]), "EVOATTN_NATIVE": "1",
           "PYTHONPATH": str(package["out"]), **(env or {})}
    p = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                       cwd=package["out"], capture_output=True, text=True, timeout=timeout,
                       env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


# Calls that differ in one thing the Python key keeps (and two pairs that differ in nothing it
# keeps), then two the C++ key hands to the Python key.
_CALLS = """
def variants():
    q = torch.randn(1, 2, 8, 16); k = torch.randn(1, 2, 8, 16); v = torch.randn(1, 2, 8, 16)
    t = lambda x: x.transpose(1, 2).contiguous().transpose(1, 2)   # same shape, other strides
    big = torch.randn(1, 2, 9, 16)
    yield "base", (q, k, v), {"causal": True}, True
    yield "base again, new tensors", (q.clone(), k.clone(), v.clone()), {"causal": True}, True
    yield "storage offset only", (torch.randn(2, 2, 8, 16)[1:], k, v), {"causal": True}, True
    yield "positional causal", (q, k, v, True), {}, True
    yield "causal false", (q, k, v), {"causal": False}, True
    yield "causal 1 (== True)", (q, k, v), {"causal": 1}, True
    yield "scale", (q, k, v), {"causal": True, "scale": 0.5}, True
    yield "scale first", (q, k, v), {"scale": 0.5, "causal": True}, True
    yield "strides of q", (t(q), k, v), {"causal": True}, True
    yield "strides of v", (q, k, t(v)), {"causal": True}, True
    yield "length", (big, big, big), {"causal": True}, True
    yield "dtype", (q.bfloat16(), k.bfloat16(), v.bfloat16()), {"causal": True}, True
    yield "requires_grad", (q, k.requires_grad_(False).clone().requires_grad_(), v), \\
        {"causal": True}, True
    yield "no grad mode", (q, k, v), {"causal": True}, False
    yield "meta device", (q.to("meta"), k.to("meta"), v.to("meta")), {"causal": True}, True
    yield "a subclass", (torch.nn.Parameter(q), k, v), {"causal": True}, True
    yield "a tensor by name", (q, k), {"v": v, "causal": True}, True
"""


def test_the_cpp_key_tells_apart_exactly_what_the_python_key_does(package):
    out = _run(package, _CALLS + """
assert pkg.call_path(wait_s=None) == "native", pkg.call_path()
seen = []
def miss(args, kwargs, key):
    seen.append(key)
    return lambda *a, **k: None
rows = []
for name, args, kwargs, grad in variants():
    with torch.set_grad_enabled(grad):
        ops._native_call({}, miss, args, kwargs)
        pykey = (ops._key(args), ops._named_key(kwargs) if kwargs else (), torch.is_grad_enabled())
    rows.append((name, seen[-1], pykey))
same = [[a[0], b[0], a[1] == b[1], a[2] == b[2]] for i, a in enumerate(rows)
        for b in rows[i + 1:] if a[1] is not None and b[1] is not None]
print(json.dumps({"same": same, "none": [r[0] for r in rows if r[1] is None]}))
""")
    assert out["none"] == ["a subclass", "a tensor by name"]
    disagree = [(a, b, c, py) for a, b, c, py in out["same"] if c != py]
    assert not disagree, disagree
    joined = {(a, b) for a, b, c, _ in out["same"] if c}
    # the Python key joins these two pairs (it keeps no storage offset; 1 == True) and no other
    assert joined == {("base", "base again, new tensors"), ("base", "storage offset only"),
                      ("base again, new tensors", "storage offset only"),
                      ("base", "causal 1 (== True)"),
                      ("base again, new tensors", "causal 1 (== True)"),
                      ("storage offset only", "causal 1 (== True)")}


_SERVE = _CALLS + """
results, outs = [], []
for name, args, kwargs, grad in variants():
    if name in ("meta device", "causal 1 (== True)"):     # SDPA takes a bool only
        continue
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            out = pkg.attention(*args, **kwargs)
        full = dict(zip(("q", "k", "v", "causal", "scale"), args), **kwargs)
        ref = torch.nn.functional.scaled_dot_product_attention(
            full["q"], full["k"], full["v"], is_causal=bool(full.get("causal", False)),
            scale=full.get("scale"))
        outs.append(bool(torch.equal(out, ref)))
q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)     # GQA: SDPA's enable_gqa
for _ in range(3):
    out = pkg.attention(q, kv, kv, causal=True, scale=0.25)
ref = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, scale=0.25,
                                                       enable_gqa=True)
outs.append(bool(torch.equal(out, ref)))
with pkg.kernel_off():
    pkg.attention(*next(variants())[1], causal=True)
print(json.dumps({"path": pkg.call_path(), "equal": outs, "stats": pkg.stats(),
                  "entries": sorted({type(k[0]).__name__ for k in ops._entries}),
                  "n": len(ops._entries),
                  "direct": sum(type(e).__name__ == "Direct" for e in ops._entries.values()),
                  "closures": sum(type(e).__name__ == "function" for e in ops._entries.values())}))
"""


def test_the_cpp_path_serves_and_counts_calls_as_the_python_path_does(package):
    native = _run(package, "assert pkg.call_path(wait_s=None) == 'native'\n" + _SERVE)
    python = _run(package, _SERVE, env={"EVOATTN_NATIVE": "0"})
    assert native["path"] == "native"
    assert python["path"] == "python (turned off by EVOATTN_NATIVE)"
    assert all(native["equal"]) and all(python["equal"])
    assert native["stats"] == python["stats"]
    assert native["stats"]["fallback"] == 3 * len(native["equal"]) + 1
    assert native["stats"]["fallback_reasons"]["kernel switched off"] == 1
    # C++ keys (bytes first) for plain calls, Python keys (tuples) for the two it hands over
    assert native["entries"] == ["bytes", "tuple"] and python["entries"] == ["tuple"]
    # SDPA called directly (no Python frame on the C++ path) wherever q, k, v come first; the
    # call passing v by name keeps a counting closure
    assert native["closures"] == python["closures"] == 1
    assert native["direct"] == native["n"] - 1 and python["direct"] == python["n"] - 1


_ODD = """
nested = torch.nested.nested_tensor([torch.randn(2, 8, 16), torch.randn(2, 5, 16)])
try:
    pkg.attention(nested, nested, nested, causal=True)
    raised = None
except Exception as e:                          # what SDPA or the key says of it: no abort
    raised = type(e).__name__
print(json.dumps({"path": pkg.call_path(), "raised": raised}))
"""


def test_a_tensor_the_cpp_key_cannot_read_goes_to_the_python_path(package):
    native = _run(package, "assert pkg.call_path(wait_s=None) == 'native'\n" + _ODD)
    python = _run(package, _ODD, env={"EVOATTN_NATIVE": "0"})
    assert native["path"] == "native"
    assert native["raised"] == python["raised"], (native, python)


def test_where_it_cannot_be_built_calls_take_the_python_path(package):
    out = _run(package, """
path = pkg.call_path(wait_s=None)
q = torch.randn(1, 2, 8, 16)
for _ in range(3):
    pkg.attention(q, q, q, causal=True)
print(json.dumps({"path": path, "stats": pkg.stats()}))
""", env={"CXX": "/bin/false"})
    assert out["path"].startswith("python (RuntimeError: cannot build _callkey.cpp"), out
    assert out["stats"]["fallback"] == 3


def test_a_build_still_running_at_exit_is_killed_with_its_compiler(package, tmp_path):
    out = _run(package, """
import time
from importlib import import_module
native = import_module(pkg.__name__ + "._native")
q = torch.randn(1, 2, 8, 16)
pkg.attention(q, q, q, causal=True)             # starts the build
deadline = time.time() + 60
while not native._state["procs"] and time.time() < deadline:
    time.sleep(0.05)
time.sleep(1.0)                                 # let it start its compiler
proc = native._state["procs"][0][0]
print(json.dumps({"pid": proc.pid, "running": proc.poll() is None,
                  "path": pkg.call_path()}))
""", env={"EVOATTN_KERNEL_CACHE": str(tmp_path / "fresh-cache")})
    assert out["running"] and out["path"] == "building", out
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(out["pid"], 0)            # anything left in the build's process group?
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(out["pid"], signal.SIGKILL)
        pytest.fail("the build's process group outlived the process that started it")
    assert not any(p.name.endswith(".so") for p in (tmp_path / "fresh-cache").rglob("*"))
    # nor its temporary directory (removed at exit, or by the build's own failure path if
    # its thread gets that far first: this holds either way)
    assert not list((tmp_path / "fresh-cache").iterdir())


def test_a_forked_child_leaves_its_parents_build_alone_and_starts_its_own(package, tmp_path):
    out = _run(package, """
import os, sys, time
from importlib import import_module
torch.set_num_threads(1)                        # OpenMP's threads do not survive a fork
native = import_module(pkg.__name__ + "._native")
q = torch.randn(1, 2, 8, 16)
pkg.attention(q, q, q, causal=True)             # the parent's build starts
deadline = time.time() + 60
while not native._state["procs"] and time.time() < deadline:
    time.sleep(0.05)
parent_build = native._state["procs"][0][0]
r, w = os.pipe()
pid = os.fork()
if pid == 0:                                    # the child: its path, then a normal exit
    os.close(r)
    before = pkg.call_path()
    pkg.attention(q, q, q, causal=True)
    os.write(w, json.dumps([before, pkg.call_path()]).encode())
    os.close(w)
    sys.exit(0)                                 # runs the child's exit handlers
os.close(w)
child = json.loads(os.read(r, 4096))
os.waitpid(pid, 0)
print(json.dumps({"child": child, "parent_build_running": parent_build.poll() is None}))
""", env={"EVOATTN_KERNEL_CACHE": str(tmp_path / "fresh-cache")})
    assert out["parent_build_running"], out
    before, after = out["child"]
    assert before == "not started" and after == "building", out


def test_the_package_ships_the_cpp_source_it_builds(package):
    pkg_dir = Path(package["out"]) / package["name"]
    assert (pkg_dir / "_callkey.cpp").read_text() == (
        Path(__file__).resolve().parent.parent / "evoattn" / "export_templates"
        / "_callkey.cpp").read_text()
    assert '"_callkey.cpp"' in (Path(package["out"]) / "pyproject.toml").read_text()


def test_op_paths_times_the_fallbacks_host_work_on_cpu_tensors(package, tmp_path):
    out = tmp_path / "paths.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.op_paths", "--export",
                        str(package["out"]), "--cpu-tensors", "--rounds", "2", "--json",
                        str(out)], capture_output=True, text=True, timeout=BUILD_WAIT_S + 120,
                       cwd=Path(__file__).resolve().parents[1],
                       env={**os.environ, "EVOATTN_KERNEL_CACHE": str(package["cache"]),
                            "EVOATTN_NATIVE": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["cfg"][-1] for r in rows] == [True, False]
    for r in rows:
        assert r["sdpa_us"] > 0
        assert {"fallback_native", "fallback_python"} <= set(r)


_COUNT = """
from importlib import import_module
guard, stats_mod = import_module(pkg.__name__ + ".guard"), import_module(pkg.__name__ + "._stats")
guard.KERNEL_DEVICE_TYPES = ("cpu",)           # the naive kernel runs on the CPU: kernel calls
stats_mod.GRAPH_DEVICE_TYPES = ("cpu",)        # and the CPU stands in for a graphed device
op = getattr(torch.ops, pkg.NAMESPACE).attention
half, bf16, d16 = (torch.randn(1, 2, 8, 64).half(), torch.randn(1, 2, 8, 64).bfloat16(),
                   torch.randn(1, 2, 8, 16).half())
made = {"kernel": 0, "dtype": 0, "head dim": 0}
for i in range(7):
    pkg.attention(half, half, half, causal=bool(i % 2)); made["kernel"] += 1
    pkg.attention(bf16, bf16, bf16); made["dtype"] += 1
    if i % 3 == 0:
        pkg.attention(d16, d16, d16, causal=True, scale=0.5); made["head dim"] += 1
        op(half, half, half, True); made["kernel"] += 1
eager = pkg.stats()
stats_mod.capturing = lambda: True             # as while a CUDA graph captures these calls
for _ in range(5):
    pkg.attention(half, half, half, causal=True)
    op(half, half, half, False)
captured = stats_mod._on_device[torch.device("cpu")][0].item()
print(json.dumps({"path": pkg.call_path(), "made": made, "eager": eager,
                  "captured": captured, "after": pkg.stats()}))
"""


@pytest.mark.parametrize("native", [True, False])
def test_stats_count_every_call_made_on_either_path_and_in_a_graph(package, native):
    """stats() equals the calls made, kernel and fallback by reason, whether attention()'s
    per-call work runs in C++ or in Python; calls made while a graph is captured are counted
    by the device's counter (which each replay raises), not on the host."""
    code = ("assert pkg.call_path(wait_s=None) == 'native'\n" if native else "") + _COUNT
    out = _run(package, code, env=None if native else {"EVOATTN_NATIVE": "0"})
    assert out["path"] == ("native" if native else "python (turned off by EVOATTN_NATIVE)")
    made = out["made"]
    assert out["eager"] == {"kernel": made["kernel"],
                            "fallback": made["dtype"] + made["head dim"],
                            "fallback_reasons": {
                                "dtype bfloat16 (verified: float16, all inputs alike)":
                                    made["dtype"],
                                "head dim 16 (verified: 64)": made["head dim"]}}, out
    assert out["captured"] == 10
    assert out["after"]["kernel"] == made["kernel"] + 10, out
