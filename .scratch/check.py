"""Device check: build each seed, compare with the float32 reference, time against SDPA."""
import ctypes, itertools, re, sys, pathlib, time, concurrent.futures as cf
sys.path.insert(0, ".")
import torch
from evaluator import build
from evaluator.problems.sdpa import Sdpa

P = Sdpa()
ARCH = build.detect_arch()
CACHE = "/tmp/evo_cache"
DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CFGS = list(P.domain_configs) + [
    {"B": 2, "H": 3, "S": 129, "D": 128, "causal": True}, {"B": 1, "H": 2, "S": 15, "D": 64, "causal": True},
    {"B": 2, "H": 4, "S": 512, "D": 64, "causal": True}, {"B": 2, "H": 4, "S": 512, "D": 128, "causal": False},
    {"B": 1, "H": 2, "S": 2, "D": 128, "causal": True}]
KNOB = re.compile(r"^(\s*#define\s+(\w+)\s+)(\S+)(\s*//\s*evoattn:\s*choice\((.*)\).*)$")

def variants(path):
    lines = pathlib.Path(path).read_text().splitlines(keepends=True)
    knobs = [(i, m) for i, l in enumerate(lines) if (m := KNOB.match(l.rstrip("\n")))]
    choices = [[c.strip() for c in m.group(5).split(",")] for _, m in knobs]
    for combo in itertools.product(*choices):
        out = list(lines)
        for (i, m), val in zip(knobs, combo):
            out[i] = m.group(1) + val + m.group(4) + "\n"
        yield ",".join(f"{m.group(2)}={v}" for (_, m), v in zip(knobs, combo)), "".join(out)

def check(fn, label, cfgs, dtypes, fast=True):
    bad = 0
    for cfg, dn in itertools.product(cfgs, dtypes):
        gen = torch.Generator(device="cuda").manual_seed(0)
        inp = P.make_inputs(cfg, DT[dn], "cuda", gen)
        ref = P.reference(inp, cfg)
        terr = (P.torch_in_dtype(inp, cfg).float() - ref).abs().max().item()
        tol = P.tolerance.bound(terr)
        if fast:
            out = P.output_like(inp, cfg).fill_(float("nan"))
            rc = P.call_cuda(fn, inp, cfg, out, torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
        else:
            rc = 0; out = fn(inp["q"], inp["k"], inp["v"], inp["causal"], inp["scale"]); torch.cuda.synchronize()
        err = (out.float() - ref).abs().max().item() if rc == 0 else float("inf")
        if not (err <= tol):
            bad += 1
            print(f"  FAIL {label} {P.label(cfg)} {dn}: rc={rc} err={err:.3g} tol={tol:.3g}", flush=True)
    return bad

def bench(fn, cfg, dn):
    gen = torch.Generator(device="cuda").manual_seed(0)
    inp = P.make_inputs(cfg, DT[dn], "cuda", gen); out = P.output_like(inp, cfg)
    st = torch.cuda.current_stream().cuda_stream
    def cand(): P.call_cuda(fn, inp, cfg, out, st)
    def base(): P.baseline(inp, cfg)
    res = []
    for f in (cand, base):
        for _ in range(3): f()
        torch.cuda.synchronize(); e0 = torch.cuda.Event(True); e1 = torch.cuda.Event(True)
        e0.record()
        for _ in range(10): f()
        e1.record(); torch.cuda.synchronize(); res.append(e0.elapsed_time(e1) / 10)
    return res

if __name__ == "__main__":
    what = sys.argv[1]
    print("arch", ARCH, torch.cuda.get_device_name(), flush=True)
    if what == "seeds":
        for name in ["naive", "fused", "mma_flash"]:
            r = build.build_fast(f"seeds/sdpa/{name}.cu", CACHE, ARCH, 300)
            print(name, "build", r.ok, f"{r.seconds:.1f}s", r.log[:2000], flush=True)
            fn = build.load_fast(r.path, "evoattn_sdpa")
            bad = check(fn, name, CFGS, ["float16", "bfloat16", "float32"])
            print(f"{name}: {bad} failures", flush=True)
            for cfg in [{"B": 4, "H": 32, "S": 1024, "D": 64, "causal": False}, {"B": 4, "H": 16, "S": 4096, "D": 128, "causal": True}]:
                if name == "naive" and cfg["S"] > 2048: continue
                c, b = bench(fn, cfg, "float16")
                print(f"  bench {name} {P.label(cfg)} fp16: {c:.3f} ms vs sdpa {b:.3f} ms", flush=True)
        r = build.build_extension("seeds/sdpa/ext_naive.cu", CACHE, ARCH, 500)
        print("ext build", r.ok, f"{r.seconds:.1f}s", r.log[-3000:], flush=True)
        if r.ok:
            mod = build.load_extension(r.path)
            print("ext_naive:", check(mod.attention, "ext", CFGS, ["float16", "bfloat16", "float32"], fast=False), "failures", flush=True)
            r2 = build.build_extension("seeds/sdpa/ext_naive.cu", CACHE, ARCH, 500)
            print("ext cached:", r2.cached, flush=True)
    else:  # knob sweep with correctness: argv[2:] seed names
        for name in sys.argv[2:]:
            vs = list(variants(f"seeds/sdpa/{name}.cu"))
            d = pathlib.Path(f"/tmp/var/{name}"); d.mkdir(parents=True, exist_ok=True)
            def b(i_lv):
                i, (label, text) = i_lv
                p = d / f"v{i}.cu"; p.write_text(text)
                return label, build.build_fast(p, CACHE, ARCH, 300)
            with cf.ThreadPoolExecutor(16) as ex:
                built = list(ex.map(b, enumerate(vs)))
            nbad = 0
            for label, r in built:
                if not r.ok:
                    print(" BUILD FAIL", name, label, r.log[:500]); nbad += 1; continue
                fn = build.load_fast(r.path, "evoattn_sdpa")
                nbad += check(fn, f"{name}[{label}]", CFGS[:8], ["float16", "bfloat16"] if name == "mma_flash" else ["float16", "float32"]) > 0
            print(f"{name}: {len(vs)} variants, {nbad} bad", flush=True)
