"""`sdpa`: forward attention softmax(q kᵀ · scale [+ causal mask]) v on (B, H, S, D)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .base import Config, OpDocs, Problem
from .common import DeviceCache, causal_keep, default_scale, masked_attention, randn, sdpa

if TYPE_CHECKING:
    from .op import OpSpec

_SHAPES = [(8, 32, 512, 64), (4, 32, 1024, 64), (2, 32, 2048, 64), (1, 32, 4096, 64),
           (1, 8, 512, 64), (4, 16, 4096, 128), (16, 16, 1024, 128)]


def _cfgs(shapes: list[tuple[int, int, int, int]]) -> tuple[Config, ...]:
    return tuple({"B": b, "H": h, "S": s, "D": d, "causal": c}
                 for (b, h, s, d) in shapes for c in (False, True))


class Sdpa(Problem):
    name = "sdpa"
    summary = "forward attention softmax(q kᵀ·scale [+causal]) v, q/k/v of shape (B, H, S, D)"
    contract = (
        "Compute out = softmax(q @ k^T * scale [+ causal mask]) @ v for q, k, v of shape "
        "(B, H, S, D), contiguous, on the same device, dtype float16/bfloat16/float32. "
        "scale defaults to 1/sqrt(D). With causal=True query i attends to keys 0..i "
        "(top-left aligned). The output has the shape, dtype and device of q and must be a "
        "plain dense torch.Tensor. Must be correct for any S >= 1 and D in {64, 128} "
        "(correctness is also checked on odd S such as 77 and 1000). Inputs must not be "
        "modified. Accumulate in float32."
    )
    cuda_symbol = "evoattn_sdpa"
    cuda_signature = (
        'extern "C" int evoattn_sdpa(const void* q, const void* k, const void* v, void* out,\n'
        "                            int B, int H, int S, int D, int dtype /*0 f16, 1 bf16, 2 f32*/,\n"
        "                            int causal, float scale, void* stream /*cudaStream_t*/);\n"
        "// returns 0 on success, else a cudaError_t code; tensors are contiguous (B, H, S, D)"
    )
    ext_signature = ("torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, "
                     "bool causal, double scale)")
    default_configs = _cfgs(_SHAPES)
    cpu_configs = _cfgs([(1, 2, 128, 64)])
    domain_configs = (
        {"B": 1, "H": 3, "S": 77, "D": 64, "causal": False},
        {"B": 1, "H": 3, "S": 77, "D": 64, "causal": True},
        {"B": 2, "H": 2, "S": 1000, "D": 128, "causal": True},
        {"B": 1, "H": 1, "S": 1, "D": 64, "causal": False},
        {"B": 1, "H": 2, "S": 1000, "D": 64, "causal": False},
    )
    cpu_domain_configs = (
        {"B": 1, "H": 1, "S": 77, "D": 64, "causal": True},
        {"B": 1, "H": 1, "S": 33, "D": 128, "causal": False},
    )
    domain = "any B, H >= 1; any S >= 1; D in {64, 128}; causal or not; scale any float"
    baseline_name = "sdpa (PyTorch's default backend: cuDNN on Hopper)"
    baseline_names = ("sdpa",)
    op_docs = OpDocs(call="attention(q, k, v, causal=True)",
                     replaces="F.scaled_dot_product_attention(q, k, v, is_causal=True)",
                     shapes="q, k, v: (B, H, S, D)", raw_args="True")

    def label(self, cfg: Config) -> str:
        c = " causal" if cfg["causal"] else ""
        return f"({cfg['B']},{cfg['H']},{cfg['S']},{cfg['D']}){c}"

    def parse_configs(self, spec: str) -> list[Config]:
        """Parses 'B,H,S,D[,causal|nc];...': without the 5th field both variants are selected."""
        if "=" in spec:
            return super().parse_configs(spec)
        out: list[Config] = []
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            fields = [f.strip() for f in part.split(",")]
            if len(fields) not in (4, 5):
                raise ValueError(f"config {part!r}: expected B,H,S,D[,causal|nc]")
            try:
                b, h, s, d = (int(x) for x in fields[:4])
            except ValueError:
                raise ValueError(f"config {part!r}: B,H,S,D must be integers") from None
            if min(b, h, s, d) < 1:
                raise ValueError(f"config {part!r}: sizes must be >= 1")
            if len(fields) == 4:
                causals = [False, True]
            elif fields[4].lower() in ("causal", "c", "true", "1"):
                causals = [True]
            elif fields[4].lower() in ("nc", "false", "0", "noncausal"):
                causals = [False]
            else:
                raise ValueError(f"config {part!r}: fifth field must be 'causal' or 'nc'")
            out += [{"B": b, "H": h, "S": s, "D": d, "causal": c} for c in causals]
        return out

    def flops(self, cfg: Config) -> float:
        f = 4.0 * cfg["B"] * cfg["H"] * cfg["S"] ** 2 * cfg["D"]
        return f / 2 if cfg["causal"] else f

    def __init__(self) -> None:
        self._masks = DeviceCache()

    def make_inputs(self, cfg: Config, dtype: Any, device: Any, gen: Any) -> dict[str, Any]:
        shape = (cfg["B"], cfg["H"], cfg["S"], cfg["D"])
        q, k, v = (randn(shape, gen, device, dtype) for _ in range(3))
        return {"q": q, "k": k, "v": v, "causal": bool(cfg["causal"]),
                "scale": default_scale(cfg["D"])}

    def _keep(self, inputs: dict[str, Any]) -> Any:
        """Returns the (S, S) causal mask for causal inputs (cached), else None."""
        q = inputs["q"]
        return causal_keep(self._masks, q.shape[-2], q.device) if inputs["causal"] else None

    def reference(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return masked_attention(inputs["q"], inputs["k"], inputs["v"], inputs["scale"],
                                keep=self._keep(inputs))

    def baseline(self, inputs: dict[str, Any], cfg: Config) -> Any:
        return sdpa(inputs["q"], inputs["k"], inputs["v"], is_causal=inputs["causal"],
                    scale=inputs["scale"])

    def baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        return {"sdpa": self.baseline}

    def extra_baselines(self) -> dict[str, Callable[[dict[str, Any], Config], Any]]:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def backend(b: Any) -> Callable[[dict[str, Any], Config], Any]:
            def run(inputs: dict[str, Any], cfg: Config) -> Any:
                with sdpa_kernel([b]):
                    return sdpa(inputs["q"], inputs["k"], inputs["v"],
                                is_causal=inputs["causal"], scale=inputs["scale"])
            return run

        def naive(inputs: dict[str, Any], cfg: Config) -> Any:
            q = inputs["q"]
            return masked_attention(q, inputs["k"], inputs["v"], inputs["scale"],
                                    keep=self._keep(inputs), compute_dtype=q.dtype)

        return {"math": backend(SDPBackend.MATH), "flash": backend(SDPBackend.FLASH_ATTENTION),
                "efficient": backend(SDPBackend.EFFICIENT_ATTENTION),
                "cudnn": backend(SDPBackend.CUDNN_ATTENTION), "naive": naive}

    def call(self, fn: Callable[..., Any], inputs: dict[str, Any], cfg: Config) -> Any:
        return fn(inputs["q"], inputs["k"], inputs["v"], causal=inputs["causal"],
                  scale=inputs["scale"])

    def output_like(self, inputs: dict[str, Any], cfg: Config) -> Any:
        import torch
        return torch.empty_like(inputs["q"])

    def call_cuda(self, cfn: Callable[..., int], inputs: dict[str, Any], cfg: Config,
                  out: Any, stream: int) -> int:
        import ctypes

        from ..contract.runtime import DTYPE_CODES    # not at the top: packages ship this module alone
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        B, H, S, D = q.shape
        code = DTYPE_CODES[str(q.dtype).replace("torch.", "")]
        return cfn(ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(k.data_ptr()),
                   ctypes.c_void_p(v.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                   ctypes.c_int(B), ctypes.c_int(H), ctypes.c_int(S), ctypes.c_int(D),
                   ctypes.c_int(code), ctypes.c_int(int(inputs["causal"])),
                   ctypes.c_float(inputs["scale"]), ctypes.c_void_p(stream))


PROBLEM = Sdpa


def op_spec() -> OpSpec:
    """Returns the op's spec: GQA calls too, k and v repeated for a kernel that needs it."""
    from .op import causal_spec
    return causal_spec(repeats_kv=True)
