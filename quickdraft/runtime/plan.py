"""Which kernel runs each step of a model, decided once when it is loaded (the model itself only follows the plan).

On an x86 CPU with AVX2 (AVX-512 VNNI where it has it: the same bits), for bf16 activations: quickdraft's own kernels
(quant/csrc/kernels.cpp) for the norms, rotary, attention of decode and verification passes, SiLU, and each decoder
layer whose linear layers all run on its int8/int4 kernels as one C++ call (the fused layer step). Everywhere else:
PyTorch's operators.
"""

from __future__ import annotations

from collections import Counter

import torch

from quickdraft.quant.gpu import ROW_TILE


def kernels_apply(model) -> bool:
    """Whether quickdraft's CPU kernels can run this model's steps here."""
    from quickdraft.quant import vnni

    return model.device.type == "cpu" and model.dtype == torch.bfloat16 and vnni.available()


def plan(model, fused_layers: bool = True) -> dict:
    """Plan every step of `model` (a Transformer); fused_layers False runs layers module by module (the
    reference of the fused step, for tests and A/B runs). Returns what was chosen, for doctor."""
    kernels = kernels_apply(model)
    chosen = model.plan(kernels, fused_layers)
    linear = Counter(layer_format(m) for m in model.modules() if isinstance(m, torch.nn.Module)
                     and (hasattr(m, "fused_operands") or isinstance(m, torch.nn.Linear)))
    out = {"cpu_kernels": kernels, **chosen, "linear": dict(linear)}
    if model.device.type == "cuda":
        out |= {"rows": ROW_TILE, "attention": attention_backends()}
    return out


def attention_backends() -> str:
    """Choose the attention backends of scaled_dot_product_attention on CUDA, and say which: the plan records it,
    doctor and gpu_check print it. Process-wide (PyTorch keeps one set of flags).

    cuDNN's is turned off: PyTorch 2.11 prefers it on sm90 with CUDA 13, and it builds (and caches) a graph of its own
    per key length, which an eager pass pays at every new length (hundreds of milliseconds), and whose failure inside
    a CUDA graph capture would turn the graphs off. Flash attention then takes the passes without a mask (eager
    steps, row by row), the memory-efficient kernel those with one (graphed passes: a mask over the whole cache),
    the math kernel whatever neither takes."""
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    torch.backends.cuda.enable_math_sdp(True)
    torch.backends.cuda.enable_cudnn_sdp(False)
    return "flash (no mask), memory-efficient (masked), math; cuDNN off"


def layer_format(module) -> str:
    """How a linear layer holds its weight: int8 / int4 on quickdraft's kernel or PyTorch's, or a float dtype."""
    fmt = getattr(module, "format", None)
    if fmt is not None:
        return f"{fmt} ({kernel_of(module)})"
    return str(module.weight.dtype).removeprefix("torch.")


def kernel_of(module) -> str:
    """Whose kernel multiplies a quantized layer: quickdraft's (VNNI on the CPU, Triton on CUDA) or PyTorch's."""
    if getattr(module, "on_cuda", False):
        return "quickdraft Triton" if getattr(module, "triton", False) else "PyTorch"
    return "quickdraft" if module.vnni else "PyTorch"


def cpu_path(model) -> tuple[str, bool]:
    """The kernel path a loaded model (weights/loader.LoadedModel) runs on, named as a user reads it, and whether
    speculation, prefix reuse and batching give its output bit for bit there (what the suite proves:
    tests/test_exact_everywhere.py), checked layer by layer: on bf16 compute every linear layer must run on
    quickdraft's kernels, or on oneDNN's bf16 GEMM with AVX-512 (off_path names those that do not). A model on CUDA:
    ("CUDA", True)."""
    from quickdraft.quant import avx2, vnni

    if model.device.type == "cuda":
        return "CUDA", True
    dtype = str(model.model.dtype).removeprefix("torch.")
    if model.model.dtype == torch.bfloat16:
        if vnni.available():  # both builds give the same bits, and the suite runs the exactness tests on each
            return f"{vnni.isa_name()} kernels, bfloat16 compute", not off_path(model)
        return f"PyTorch's kernels ({model.weights} weights), bfloat16 compute", False
    if model.model.dtype == torch.float32 and avx2.available():
        quantized = model.weights in ("int8", "int4", "mixed")
        return (f"AVX2 float32 kernels ({model.weights} weights on PyTorch's)" if quantized
                else "AVX2 float32 kernels, float32 compute", not quantized)
    return f"generic (PyTorch's kernels), {dtype} compute", False


def off_path(model) -> list[str]:
    """The linear layers of a bf16 model on quickdraft's CPU kernels that run elsewhere where that is not proven
    exact: PyTorch's bf16 GEMM (a layer kept in bf16: a mixture of experts' router, a shape the int kernels refuse) on
    a CPU without AVX-512, where PyTorch emulates it (docs/performance.md: exactness on every CPU)."""
    from quickdraft.quant import vnni

    if vnni.isa_name() != "AVX2":  # oneDNN's bf16 GEMM with AVX-512: proven row- and thread-invariant
        return []
    return [name for name, m in model.model.named_modules()
            if (isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.bfloat16)
            or (hasattr(m, "fused_operands") and not getattr(m, "vnni", True))]


def cpu_path_line(model) -> str:
    """cpu_path as one line: serve's start and doctor print it."""
    path, exact = cpu_path(model)
    if exact:
        return f"{path}: output bit-exact with speculation, prefix reuse and batching"
    off = off_path(model) if model.model.dtype == torch.bfloat16 and model.device.type == "cpu" else []
    if off:
        named = ", ".join(off[:3]) + (", ..." if len(off) > 3 else "")
        return (f"{path}: NOT proven bit-exact: {len(off)} linear layers run on PyTorch's emulated bf16 GEMM on this "
                f"CPU without AVX-512 ({named}), whose sums may be ordered by a pass's rows and threads: speculation "
                "may change logprobs, and tokens at near ties")
    return (f"{path}: NOT proven bit-exact (PyTorch's kernels may order a row's sums by the rows and threads of a "
            "pass: speculation may change logprobs, and tokens at near ties); the exact paths are bfloat16 on "
            "quickdraft's kernels (a CPU with AVX2 and FMA, or AVX-512 VNNI) and float32 --weights bf16 on AVX2 "
            "(--dtype)")
