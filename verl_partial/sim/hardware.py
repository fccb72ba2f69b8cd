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
    """One accelerator: HBM capacity (bytes), HBM bandwidth (bytes/s), dense bf16 tensor FLOP/s.

    ``device_names``: the names the engines report for it (vLLM's ``current_platform.get_device_name()``, NVML's
    ``nvmlDeviceGetName``), each checked against the fused-MoE tuning files named after it in the pinned vLLM wheel
    (tests/unit/test_vllm_device_names.py). ``partial.max_calls_per_server=auto`` finds a server's GPU by them.
    """

    name: str
    hbm_bytes: float
    hbm_bandwidth: float
    bf16_flops: float
    device_names: tuple[str, ...] = ()


# NVIDIA H100 SXM5 data sheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS bf16 dense (1,979 with sparsity).
H100_SXM = GpuSpec("H100-SXM", 80 * GB, 3.35 * TB, 989e12, ("NVIDIA H100 80GB HBM3",))
# H100 PCIe data sheet: 80 GB HBM2e, 2.0 TB/s, 756 TFLOPS bf16 dense (1,513 with sparsity).
H100_PCIE = GpuSpec("H100-PCIe", 80 * GB, 2.0 * TB, 756e12, ("NVIDIA H100 PCIe",))
# H800 SXM: the H100 SXM die and memory with a cut NVLink (400 GB/s); same HBM and tensor figures.
H800_SXM = GpuSpec("H800-SXM", 80 * GB, 3.35 * TB, 989e12, ("NVIDIA H800",))
# NVIDIA H20 (China export part): 96 GB HBM3, 4.0 TB/s, 148 TFLOPS bf16/fp16 dense.
H20 = GpuSpec("H20", 96 * GB, 4.0 * TB, 148e12, ("NVIDIA H20",))
# NVIDIA H200 SXM data sheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS bf16 dense (the H100's tensor cores).
H200_SXM = GpuSpec("H200-SXM", 141 * GB, 4.8 * TB, 989e12, ("NVIDIA H200",))
# NVIDIA A100 SXM4 80GB data sheet: 2,039 GB/s HBM2e, 312 TFLOPS bf16 dense (624 with sparsity). The A800 (China
# export part) is the same die and memory with a cut NVLink.
A100_SXM_80GB = GpuSpec("A100-SXM-80GB", 80 * GB, 2.039 * TB, 312e12, ("NVIDIA A100-SXM4-80GB",))
A800_SXM_80GB = GpuSpec("A800-SXM-80GB", 80 * GB, 2.039 * TB, 312e12, ("NVIDIA A800-SXM4-80GB",))
# NVIDIA A100 SXM4 40GB data sheet: 1,555 GB/s HBM2, 312 TFLOPS bf16 dense.
A100_SXM_40GB = GpuSpec("A100-SXM-40GB", 40 * GB, 1.555 * TB, 312e12, ("NVIDIA A100-SXM4-40GB",))
# NVIDIA L40S data sheet: 48 GB GDDR6, 864 GB/s, 362 TFLOPS bf16 dense (733 with sparsity).
L40S = GpuSpec("L40S", 48 * GB, 0.864 * TB, 362e12, ("NVIDIA L40S",))
# NVIDIA HGX B200 data sheet, per GPU: 180 GB HBM3e, 8 TB/s, 2.25 PFLOPS bf16 dense (4.5 with sparsity).
B200 = GpuSpec("B200", 180 * GB, 8.0 * TB, 2.25e15, ("NVIDIA B200",))
# AMD Instinct MI300X data sheet: 192 GB HBM3, 5.3 TB/s, 1,307 TFLOPS bf16 dense.
MI300X = GpuSpec("MI300X", 192 * GB, 5.3 * TB, 1307e12, ("AMD Instinct MI300X",))

GPUS = {
    gpu.name: gpu
    for gpu in (
        H100_SXM,
        H100_PCIE,
        H800_SXM,
        H20,
        H200_SXM,
        A100_SXM_80GB,
        A800_SXM_80GB,
        A100_SXM_40GB,
        L40S,
        B200,
        MI300X,
    )
}
#: Each GPU by the name its engine reports (``GpuSpec.device_names``).
GPUS_BY_DEVICE_NAME = {device: gpu for gpu in GPUS.values() for device in gpu.device_names}


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


def compute_knee(gpu: GpuSpec, efficiency: Efficiency | None = None, bytes_per_param: int = 2) -> int:
    """Most decoding requests one engine step serves at the cost of the weights' read alone: the read takes
    ``bytes_per_param x params / bandwidth``, each request's linear layers ``2 x params / FLOP/s``, so the model's
    size cancels and the knee is the GPU's (about 0.7 x FLOP/s over bytes/s for bf16 weights). Weights and matmuls of
    one width (bf16, or fp8 weights on fp8 tensor cores) give the same knee; weight-only quantisation halves it."""
    efficiency = efficiency or Efficiency()
    read_per_param = bytes_per_param / (gpu.hbm_bandwidth * efficiency.bandwidth)
    compute_per_param_and_request = 2.0 / (gpu.bf16_flops * efficiency.compute)
    return int(read_per_param // compute_per_param_and_request)


def knee_of_servers(device_names: dict[str, str | None]) -> int | None:
    """Calls per server ``partial.max_calls_per_server=auto`` caps at: the smallest compute knee of the servers' GPUs,
    by the name each server's engine reports (None: the server runs on no GPU, e.g. vLLM's CPU build or our CPU
    engine). None when no server names a GPU. A GPU not in the table is refused, naming it: a knee guessed too low
    halves throughput (docs/evidence.md#sim-knee), and one guessed too high is no cap at all."""
    unknown = sorted({name for name in device_names.values() if name is not None and name not in GPUS_BY_DEVICE_NAME})
    if unknown:
        servers = sorted(address for address, name in device_names.items() if name in unknown)
        raise ValueError(
            f"partial.max_calls_per_server=auto does not know the GPU {unknown} of servers {servers}: set "
            f"partial.max_calls_per_server to an integer (the GPU's compute knee, about 0.7 x bf16 FLOP/s over HBM "
            f"bytes/s; 512 for no cap); known GPUs: {sorted(GPUS_BY_DEVICE_NAME)}"
        )
    knees = [compute_knee(GPUS_BY_DEVICE_NAME[name]) for name in device_names.values() if name is not None]
    return min(knees) if knees else None
