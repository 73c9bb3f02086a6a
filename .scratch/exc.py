import os, sys, subprocess, torch
from torch.utils.cpp_extension import load
mode = sys.argv[1]
d = f"/tmp/exc_{mode}"; os.makedirs(d, exist_ok=True)
body = '#include <torch/extension.h>\ntorch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal, double scale) {\n  TORCH_CHECK(q.size(-1) == 64, "bad D ", q.size(-1));\n  return q.clone();\n}\n'
flags = ["-gencode=arch=compute_90a,code=sm_90a", "-O3"]
if mode == "cu":   # wrapper .cu including the source
    open(f"{d}/src.cu", "w").write(body)
    open(f"{d}/w.cu", "w").write('#include <torch/extension.h>\n#include "src.cu"\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("attention", &attention); }\n')
    srcs = [f"{d}/w.cu"]
elif mode == "cpp":  # binding in .cpp, source in .cu
    open(f"{d}/src.cu", "w").write(body)
    open(f"{d}/w.cpp", "w").write('#include <torch/extension.h>\ntorch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal, double scale);\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("attention", &attention); }\n')
    srcs = [f"{d}/w.cpp", f"{d}/src.cu"]
m = load(name=f"exc_{mode}", sources=srcs, build_directory=d, extra_cuda_cflags=flags, verbose=False)
print(mode, "ok call:", m.attention(torch.zeros(1, 64), torch.zeros(1), torch.zeros(1), False, 1.0).shape, flush=True)
try:
    m.attention(torch.zeros(1, 96), torch.zeros(1), torch.zeros(1), False, 1.0); print(mode, "no exception")
except Exception as e:
    print(mode, "raised", type(e).__name__, str(e).splitlines()[0], flush=True)
