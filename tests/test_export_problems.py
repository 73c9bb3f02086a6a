"""Each built-in problem's op: its schema, the kernel called with the problem's own arguments
(the seed on the Triton CPU interpreter agrees with the op's SDPA fallback), and its
Hugging Face mapping (GQA k/v, a sliding window) in a real tiny model."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from evoattn.contract.types import ConfigResult, EvalResult, Verdict
from evoattn.config import RunConfig, config_to_dict
from evoattn.export import export_run
from evoattn.store import RunStore
from evoattn.types import Program, program_id

ROOT = Path(__file__).resolve().parent.parent
SEEDS = {"sdpa": "sdpa/flash_triton.py", "gqa": "gqa/gqa_triton.py",
         "masked": "masked/masked_triton.py", "sliding_window": "sliding_window/window_triton.py",
         "strided": "strided/strided_triton.py", "alibi": "alibi/alibi_triton.py"}
# (the op's schema, a call of the op on q, k, v, mask in the test's scope)
CALLS = {
    "sdpa": ("bool causal=False, float? scale=None", "attention(q, k, v, causal=True)"),
    "gqa": ("bool causal=False, float? scale=None", "attention(q, k[:, :1], v[:, :1], causal=True)"),
    "masked": ("Tensor mask, float? scale=None", "attention(q, k, v, mask, scale=0.2)"),
    "sliding_window": ("int window, float? scale=None", "attention(q, k, v, window=5)"),
    "strided": ("int stride, float? scale=None", "attention(q, k, v, stride=3)"),
    "alibi": ("Tensor slopes, float? scale=None", "attention(q, k, v, torch.tensor([0.5, 0.25]))"),
}


def export_problem(tmp: Path, problem: str, dtypes: tuple[str, ...] = ("float16",),
                   device: str = "cuda") -> tuple[Path, object]:
    """Exports a run of the problem's seed, evaluated (as stored) on an H100 in these dtypes
    (device "cpu": in Triton's interpreter)."""
    source = (ROOT / "seeds" / SEEDS[problem]).read_text()
    params = {"B": 1, "H": 2, "S": 128, "D": 64}
    gpu = device == "cuda"
    res = EvalResult(verdict=Verdict.PASS, reason="", fitness=1.0, problem=problem,
                     configs=tuple(ConfigResult(params=params, dtype=d, verdict=Verdict.PASS)
                                   for d in dtypes),
                     device="NVIDIA H100" if gpu else "cpu", timing_device=device,
                     device_info={"capability": "9.0"} if gpu else {})
    cfg = config_to_dict(RunConfig())
    cfg["problem"] = problem
    prog = Program(id=program_id(source), source=source, suffix=".py", parent_id=None,
                   iteration=0, island=0, mutator="seed", change="", result=res)
    with RunStore.open(tmp / "run", cfg, create=True) as s:
        s.commit_iteration(iteration=0, program=prog, rejection=None, llm_usage=None,
                           rng_state=random.Random(0).getstate(), population_snapshot={})
    return tmp / "out", export_run(tmp / "run", tmp / "out")


def _py(code: str, cwd: Path) -> str:
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@pytest.mark.parametrize("problem", sorted(SEEDS))
def test_op_calls_the_kernel_with_the_problems_arguments(tmp_path, problem):
    out, s = export_problem(tmp_path, problem)
    schema, call = CALLS[problem]
    got = _py(f"""
        import json, torch
        import {s.package} as pkg
        from {s.package} import ops
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 23, 64) for _ in range(3))
        mask = torch.zeros(1, 1, 23, 23).masked_fill(torch.rand(23, 23) < 0.3, float("-inf"))
        mask[..., 0] = 0.0              # every query row keeps a key
        attention = lambda *a, **kw: ops.SPEC.bind(a, kw)
        args = {call}
        kernel = getattr(pkg.load_kernel_module(), "attention")
        mine = ops.SPEC.call_kernel(kernel, *args.values())
        theirs = ops.SPEC.fallback_for(args)(*args.values())
        op = pkg.{call}
        print(json.dumps({{"schema": str(getattr(torch.ops, pkg.NAMESPACE).attention.default._schema),
                           "err": (mine - theirs).abs().max().item(),
                           "op_err": (op - theirs).abs().max().item(), "stats": pkg.stats()}}))
    """, cwd=out)
    r = json.loads(got.splitlines()[-1])
    assert f"(Tensor q, Tensor k, Tensor v, {schema}) -> Tensor" in r["schema"]
    assert r["err"] < 1e-3, r              # the kernel, called as the op calls it, is right
    assert r["op_err"] == 0.0 and r["stats"] == {
        "kernel": 0, "fallback": 1,
        "fallback_reasons": {"cpu tensors (the kernel runs on CUDA GPUs)": 1}}


def test_guard_refuses_shapes_outside_the_contract(tmp_path):
    out, s = export_problem(tmp_path, "gqa")
    got = _py(f"""
        import torch
        from {s.package} import ops, guard
        v = ops.META["verified"]
        q = torch.randn(1, 4, 8, 64)
        bad = ops.SPEC.bind((q, torch.randn(1, 3, 8, 64), torch.randn(1, 3, 8, 64)), {{}})
        print(ops.SPEC.shape_refusal(bad))
        print(guard.refusal(v, ops.SPEC, ops.SPEC.bind((q, q, q), {{}})))
        print(v)
    """, cwd=out)
    shape, device, verified = got.strip().splitlines()[-3:]
    assert "Hq % Hkv == 0" in shape and device == "cpu tensors (the kernel runs on CUDA GPUs)"
    assert "'capabilities': ['9.0']" in verified and "'head_dims': [64]" in verified


def _tiny_model_run(out: Path, package: str, model_code: str) -> dict:
    got = _py(f"""
        import json, torch
        import transformers
        import {package} as pkg
        from {package} import hf
        hf.register()
        torch.manual_seed(0)
        {model_code}
        ids = torch.randint(0, 97, (2, 21))
        with torch.no_grad():
            model.set_attn_implementation("sdpa")
            ref = model(ids).logits
            model.set_attn_implementation("evoattn")
            pkg.reset_stats()
            got = model(ids).logits
        print(json.dumps({{"err": (got - ref).abs().max().item(), "stats": pkg.stats()}}))
    """, cwd=out)
    return json.loads(got.splitlines()[-1])


def test_gqa_model_calls_reach_the_op_in_a_tiny_llama(tmp_path):
    out, s = export_problem(tmp_path, "gqa")
    r = _tiny_model_run(out, s.package, textwrap.dedent("""\
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, vocab_size=97)).eval()""").replace("\n", "\n        "))
    # the op's guard saw the calls (the CPU makes it fall back): the HF layer let them through
    assert r["err"] < 1e-5 and r["stats"]["fallback_reasons"] == {
        "cpu tensors (the kernel runs on CUDA GPUs)": 2}


def test_sliding_window_reaches_the_op_with_the_models_window(tmp_path):
    out, s = export_problem(tmp_path, "sliding_window")
    r = _tiny_model_run(out, s.package, textwrap.dedent("""\
        model = transformers.MistralForCausalLM(transformers.MistralConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=97, sliding_window=6)).eval()""")
        .replace("\n", "\n        "))
    # the op's fallback computed the window the kernel would (keys i-5 .. i), as HF's SDPA did
    assert r["err"] < 1e-5 and r["stats"]["fallback_reasons"] == {
        "cpu tensors (the kernel runs on CUDA GPUs)": 2}


# The kernel served on the CPU: a package verified in Triton's interpreter, with the guard told
# that the CPU may run it (a real package serves CUDA only), so the op's kernel path runs here.
_SERVE_ON_CPU = """
    import json, torch, torch.nn.functional as F
    import {package} as pkg
    from {package} import guard
    guard.KERNEL_DEVICE_TYPES = ("cpu",)
    mod = pkg.load_kernel_module()            # the module the op's kernel comes from
    launched = []
    real_fwd = mod._attn_fwd

    written = []                              # and where it writes its output
    class Recorder:                           # the Triton launch: records q, k, v pointers
        def __getitem__(self, grid):
            def run(*args, **kw):
                launched.append([getattr(a, "base", a).data_ptr() for a in args[:3]])
                written.append(getattr(args[3], "base", args[3]).data_ptr())
                return real_fwd[grid](*args, **kw)
            return run
    mod._attn_fwd = Recorder()

    def ref(q, k, v, causal):
        k, v = (t.float().repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
        return F.scaled_dot_product_attention(q.float(), k, v, is_causal=causal)
"""


def _serve(out: Path, package: str, body: str) -> dict:
    code = textwrap.dedent(_SERVE_ON_CPU.format(package=package)) + textwrap.dedent(body)
    return json.loads(_py(code, cwd=out).splitlines()[-1])


def test_each_verified_dtype_is_served_and_others_fall_back(tmp_path):
    for dtypes in (("bfloat16", "float16"), ("float16",)):
        out, s = export_problem(tmp_path / dtypes[0], "sdpa", dtypes, device="cpu")
        r = _serve(out, s.package, """
            r = {}
            for dtype in (torch.float16, torch.bfloat16):
                pkg.reset_stats()
                q, k, v = (torch.randn(1, 2, 33, 64).to(dtype) for _ in range(3))
                got = pkg.attention(q, k, v, causal=True)
                r[str(dtype)] = {"stats": pkg.stats(), "dtype": str(got.dtype),
                                 "err": (got.float() - ref(q, k, v, True)).abs().max().item()}
            print(json.dumps(r))
        """)
        f16, bf16 = r["torch.float16"], r["torch.bfloat16"]
        assert f16["stats"]["kernel"] == 1 and f16["err"] < 4e-3, f16
        assert bf16["dtype"] == "torch.bfloat16" and bf16["err"] < 3e-2, bf16
        if "bfloat16" in dtypes:
            assert bf16["stats"]["kernel"] == 1 and bf16["stats"]["fallback"] == 0, bf16
        else:
            assert bf16["stats"]["kernel"] == 0 and bf16["stats"]["fallback_reasons"] == {
                "dtype bfloat16 (verified: float16, all inputs alike)": 1}, bf16


def test_model_layouts_and_gqa_reach_the_kernel_without_a_copy(tmp_path):
    """transformers' (B, S, H, D) views and k, v with fewer heads go through the op to the
    Triton launch as they lie (after the op's one check of that call key), and match float32;
    the kernel writes the output laid out as q, and that tensor is what an eager caller gets
    (no copy on the way out either, and none when transformers transposes it back); the op
    (what torch.compile calls) returns it contiguous, as its fake says."""
    out, s = export_problem(tmp_path, "sdpa", ("float16", "bfloat16"), device="cpu")
    r = _serve(out, s.package, """
        r = {}
        for dtype in (torch.float16, torch.bfloat16):
            q = torch.randn(2, 37, 4, 64).to(dtype).transpose(1, 2)     # (B, H, S, D) views
            k, v = (torch.randn(2, 37, 2, 64).to(dtype).transpose(1, 2) for _ in range(2))
            pkg.attention(q, k, v, causal=True)                          # decides (checks)
            pkg.reset_stats()
            launched.clear()
            written.clear()
            got = pkg.attention(q, k, v, causal=True)
            stats = pkg.stats()
            op = getattr(torch.ops, pkg.ops.NAMESPACE).attention(q, k, v, True)
            back = got.transpose(1, 2).contiguous()            # what transformers does
            r[str(dtype)] = {"launched": list(launched), "given": [t.data_ptr() for t in (q, k, v)],
                             "err": (got.float() - ref(q, k, v, True)).abs().max().item(),
                             "stats": stats, "q_layout": got.stride() == q.stride(),
                             "op_layout": op.is_contiguous(),
                             "written": written[0] == got.data_ptr() == back.data_ptr()}
        print(json.dumps(r))
    """)
    for dtype, tol in (("torch.float16", 4e-3), ("torch.bfloat16", 3e-2)):
        got = r[dtype]
        assert got["launched"][0] == got["given"], got          # on the inputs as they lie
        assert got["q_layout"] and got["op_layout"] and got["written"], got
        assert got["err"] < tol and got["stats"]["kernel"] == 1, got


def test_a_kernel_that_ignores_strides_gets_contiguous_copies(tmp_path):
    """A kernel that declares strided inputs but reads them as contiguous fails the op's check
    of that layout, so the op gives it copies: the result stays right."""
    out, s = export_problem(tmp_path, "sdpa", ("float16",), device="cpu")
    r = _serve(out, s.package, """
        real_attention = mod.attention
        def ignores_strides(q, k, v, causal=False, scale=None):
            flat = [t.as_strided(t.shape, torch.empty(t.shape).stride()) for t in (q, k, v)]
            return real_attention(*flat, causal=causal, scale=scale)
        mod.attention = ignores_strides
        q, k, v = (torch.randn(1, 37, 2, 64).half().transpose(1, 2) for _ in range(3))
        got = [pkg.attention(q, k, v) for _ in range(2)]
        print(json.dumps({"errs": [(g.float() - ref(q, k, v, False)).abs().max().item()
                                   for g in got],
                          "copied": all(p != [t.data_ptr() for t in (q, k, v)]
                                        for p in launched[-2:]),
                          "stats": pkg.stats()}))
    """)
    assert max(r["errs"]) < 4e-3 and r["copied"] and r["stats"]["kernel"] == 2, r


def test_eager_calls_skip_the_dispatcher_unless_a_mode_is_watching(tmp_path):
    """attention() runs the kernel without entering PyTorch's dispatcher; under a dispatch mode
    the call goes through the op, so the mode sees it."""
    out, s = export_problem(tmp_path, "sdpa", ("float16",), device="cpu")
    r = _serve(out, s.package, """
        from torch.utils._python_dispatch import TorchDispatchMode

        class Seen(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.ops = []
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.ops.append(str(func))
                return func(*args, **(kwargs or {}))

        q, k, v = (torch.randn(1, 2, 16, 64).half() for _ in range(3))
        pkg.attention(q, k, v)
        launched.clear()
        with torch.profiler.profile() as prof:
            plain = pkg.attention(q, k, v)
        with Seen() as seen:
            watched = pkg.attention(q, k, v)
        name = f"{pkg.NAMESPACE}.attention"
        print(json.dumps({"profiled": [e.name for e in prof.events() if "attention" in e.name],
                          "seen": [o for o in seen.ops if o.startswith(name)],
                          "launches": len(launched), "same": torch.equal(plain, watched)}))
    """)
    assert r["profiled"] == [] and r["seen"] == [f"{s.namespace}.attention.default"], r
    assert r["launches"] == 2 and r["same"], r


def test_a_llama_prefill_reaches_the_kernel_with_its_own_views_and_kv_heads(tmp_path):
    """Through hf.register(): each layer's call reaches the kernel entry with transformers'
    (B, S, H, D) view of q and k, v at their own (fewer) heads, and the logits match SDPA's."""
    out, s = export_problem(tmp_path, "sdpa", ("float16",), device="cpu")
    r = _serve(out, s.package, """
        import transformers
        seen = []
        real_attention = mod.attention
        def watched(q, k, v, causal=False, scale=None):
            seen.append([q.is_contiguous(), q.shape[1], k.shape[1]])
            return real_attention(q, k, v, causal=causal, scale=scale)
        mod.attention = watched
        pkg.hf.register()
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=97)).eval().half()
        ids = torch.randint(0, 97, (1, 19))
        with torch.no_grad():
            model.set_attn_implementation("sdpa")
            ref = model(ids).logits.float()
            model.set_attn_implementation("evoattn")
            model(ids)                               # decides (one layout check)
            seen.clear()
            pkg.reset_stats()
            got = model(ids).logits.float()
        print(json.dumps({"err": (got - ref).abs().max().item(), "seen": seen,
                          "stats": pkg.stats()}))
    """)
    assert r["stats"]["kernel"] == 2 and r["stats"]["fallback"] == 0, r
    assert r["seen"] == [[False, 2, 1], [False, 2, 1]], r       # views, k/v unrepeated
    assert r["err"] < 5e-2, r
