"""Published hardware and model figures the GPU-regime simulator is built from (docs/method/gpu-simulator.md).

Nothing here is fitted to a result: every number is a data-sheet or config.json value, or an efficiency
factor whose source is named next to it. Users pass their own shape through ``ModelSpec.dense`` or the
``verl-partial simulate`` flags.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: HBM capacity (bytes), HBM bandwidth (bytes/s), dense bf16 tensor FLOP/s."""

    name: str
    hbm_bytes: float
    hbm_bandwidth: float
    bf16_flops: float


# NVIDIA H100 SXM5 data sheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS bf16 dense (1,979 with sparsity).
H100_SXM = GpuSpec("H100-SXM", 80 * GB, 3.35 * TB, 989e12)
# H800 SXM: the H100 SXM die and memory with a cut NVLink (400 GB/s); same HBM and tensor figures.
H800_SXM = GpuSpec("H800-SXM", 80 * GB, 3.35 * TB, 989e12)
# NVIDIA H20 (China export part): 96 GB HBM3, 4.0 TB/s, 148 TFLOPS bf16/fp16 dense.
H20 = GpuSpec("H20", 96 * GB, 4.0 * TB, 148e12)

# NVIDIA H200 SXM data sheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS bf16 dense (the H100's tensor cores).
H200_SXM = GpuSpec("H200-SXM", 141 * GB, 4.8 * TB, 989e12)

GPUS = {gpu.name: gpu for gpu in (H100_SXM, H800_SXM, H20, H200_SXM)}


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder: what a decode step reads and computes.

    ``params`` counts every weight read once per engine step (embedding rows are gathered, not read in
    full, but the untied LM head of Qwen2.5 is: counting both overstates weight bytes by < 8 % at 7B).
    """

    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V, every layer, bf16: 2 x layers x kv_heads x head_dim x 2 bytes."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def linear_flops_per_token(self) -> float:
        """2 FLOPs per weight per token (one multiply-add)."""
        return 2.0 * self.params

    @property
    def attention_flops_per_context_token(self) -> float:
        """QK^T and PV for one query token against one cached token: 2 x 2 x layers x heads x head_dim."""
        return 4.0 * self.layers * self.heads * self.head_dim

    @staticmethod
    def dense(params: float) -> ModelSpec:
        """A generic dense model of ``params`` weights shaped like the Qwen2.5 family (for ``--model-params``).

        Layers, width and GQA follow the nearest Qwen2.5 size; use a preset when the exact shape is known.
        """
        nearest = min(MODELS.values(), key=lambda m: abs(m.params - params))
        return ModelSpec(
            f"dense-{params / 1e9:g}B",
            params,
            nearest.layers,
            nearest.hidden,
            nearest.heads,
            nearest.kv_heads,
            nearest.head_dim,
        )


# config.json of Qwen/Qwen2.5-7B (and Qwen2.5-Math-7B, same architecture): 28 layers, hidden 3584,
# 28 query heads, 4 KV heads, head_dim 128; 7.61 B parameters (model card).
QWEN25_7B = ModelSpec("Qwen2.5-7B", 7.61e9, 28, 3584, 28, 4, 128)
# config.json of Qwen/Qwen2.5-32B: 64 layers, hidden 5120, 40 query heads, 8 KV heads, head_dim 128;
# 32.5 B parameters (model card).
QWEN25_32B = ModelSpec("Qwen2.5-32B", 32.5e9, 64, 5120, 40, 8, 128)

MODELS = {model.name: model for model in (QWEN25_7B, QWEN25_32B)}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak a serving engine reaches; applied to the roofline, fixed before any result.

    ``bandwidth``: model bandwidth utilisation (MBU) of decode. Optimised CUDA serving stacks (vLLM,
    TensorRT-LLM) reach 70-85 % of peak HBM bandwidth; we take the low end, 0.70.
    ``compute``: model FLOPs utilisation of large-batch GEMMs in inference (prefill, big decode batches);
    0.50, the usual planning figure (PaLM inference paper, Pope et al. 2022, reports 40-76 % MFU for
    large-batch prefill/decode on TPU v4).
    """

    bandwidth: float = 0.70
    compute: float = 0.50
