import sys, torch
sys.path.insert(0, "."); sys.path.insert(0, ".scratch")
from check import P, check, CFGS, ARCH, CACHE, DT
from evaluator import build
mode = sys.argv[1]
if mode == "neg":
    src = open("seeds/sdpa/mma_flash.cu").read().replace("scale * LOG2E);", "scale * LOG2E * 1.01f);")
    open("/tmp/neg.cu", "w").write(src)
    r = build.build_fast("/tmp/neg.cu", CACHE, ARCH, 300)
    print("negative control failures (want > 0):", check(build.load_fast(r.path, "evoattn_sdpa"), "neg", CFGS[:3], ["float16", "float32"]))
    for name in ["mma_flash", "fused"]:
        fn = build.load_fast(build.build_fast(f"seeds/sdpa/{name}.cu", CACHE, ARCH, 300).path, "evoattn_sdpa")
        cfg = {"B": 1, "H": 2, "S": 77, "D": 64, "causal": True}
        for dn in ["float16", "bfloat16"]:
            inp = P.make_inputs(cfg, DT[dn], "cuda", torch.Generator(device="cuda").manual_seed(1))
            for n in "qkv":
                t = inp[n]; buf = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
                inp[n] = buf[1:].view(t.shape).copy_(t)
            ref = P.reference(inp, cfg)
            out = torch.empty(inp["q"].numel() + 1, dtype=inp["q"].dtype, device="cuda")[1:].view(inp["q"].shape)
            rc = P.call_cuda(fn, inp, cfg, out, torch.cuda.current_stream().cuda_stream); torch.cuda.synchronize()
            print(name, "misaligned", dn, "rc", rc, "err", (out.float() - ref).abs().max().item())
        rc = fn(*([None] * 4), 1, 1, 8, 96, 0, 0, 1.0, None)
        print(name, "D=96 rc (want 1 = cudaErrorInvalidValue):", rc)
else:  # under compute-sanitizer: small odd configs
    for name in sys.argv[2:]:
        fn = build.load_fast(build.build_fast(f"seeds/sdpa/{name}.cu", CACHE, ARCH, 300).path, "evoattn_sdpa")
        cfgs = [{"B": 1, "H": 2, "S": 77, "D": 64, "causal": True}, {"B": 1, "H": 1, "S": 33, "D": 128, "causal": False},
                {"B": 1, "H": 1, "S": 1, "D": 64, "causal": True}]
        print(name, "sanitized failures:", check(fn, name, cfgs, ["float16", "float32"]), flush=True)
if mode == "ext256":
    src = open("seeds/sdpa/ext_naive.cu").read().replace("#define THREADS 128", "#define THREADS 256")
    open("/tmp/ext256.cu", "w").write(src)
    r = build.build_extension("/tmp/ext256.cu", CACHE, ARCH, 500)
    print("ext256 build", r.ok, r.log[-1500:])
    mod = build.load_extension(r.path)
    print("ext256 failures:", check(mod.attention, "ext256", CFGS, ["float16", "bfloat16", "float32"], fast=False))
    for shape in [(1, 1, 8, 96), (1, 8, 96)]:
        try:
            mod.attention(*(torch.randn(shape, device="cuda") for _ in range(3)), False, 0.1)
            print(shape, "NO EXCEPTION")
        except Exception as e:
            print(shape, "raises", type(e).__name__, repr(str(e)[:200]))
    print("done")
