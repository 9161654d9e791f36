"""Plan targets (``--device`` of ``pagellm plan``) and the estimates that stand in for what the
engine measures at start-up.

Targets: ``cpu`` (this host: the memory available now), ``cuda``/``cuda:N`` (a GPU of this host,
its total memory as CUDA reports it), a size such as ``80GiB`` or ``24GB`` (one GPU of that
memory), or a GPU name. Named GPUs use the memory.total that nvidia-smi shows; CUDA reports a
few hundred MiB less on some boards, so give an exact size when it matters.

Estimates (per rank, T = max_num_batched_tokens, R = min(T, max_num_seqs), b = dtype bytes):
- Peak activations, what the engine's profiling forward of T tokens measures: the larger of
  * one layer's MLP: residual and normed input (2 x T x hidden) plus the gate/up output and the
    SiLU product (4 x T x intermediate / tp), all in b bytes;
  * the logits of R rows: R x vocab x (b + 4) (model dtype, then float32) + T x hidden x b.
  Attention (flash/Triton kernels, no T x T scores) and norms stay below these for
  Llama/Qwen-shaped models.
- Non-torch overhead on CUDA: 512 MiB (CUDA context and library kernels), plus 256 MiB for NCCL
  buffers when tensor_parallel_size > 1. On CPU the KV budget is explicit, so activations are
  shown for information and nothing is subtracted.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.planning.model_spec import ModelSpec

MiB = 1 << 20
CUDA_CONTEXT_BYTES = 512 * MiB
NCCL_BYTES = 256 * MiB

# name -> (memory.total in MiB as nvidia-smi shows it, description)
GPU_MEMORY_MIB: dict[str, tuple[int, str]] = {
    "h100": (81559, "NVIDIA H100 80GB HBM3"),
    "h100-80gb": (81559, "NVIDIA H100 80GB HBM3"),
    "h200": (143771, "NVIDIA H200 141GB HBM3e"),
    "a100-80gb": (81920, "NVIDIA A100 80GB"),
    "a100-40gb": (40960, "NVIDIA A100 40GB"),
    "l40s": (46068, "NVIDIA L40S 48GB"),
    "a10g": (23028, "NVIDIA A10G 24GB"),
    "l4": (23034, "NVIDIA L4 24GB"),
    "rtx4090": (24564, "NVIDIA GeForce RTX 4090 24GB"),
}


@dataclass(frozen=True)
class DeviceTarget:
    name: str  # as given
    kind: str  # "cpu" or "cuda"
    total_bytes: int  # one GPU's memory, or this host's available memory
    description: str

    def as_dict(self) -> dict[str, str | int]:
        return {"name": self.name, "kind": self.kind, "total_bytes": self.total_bytes,
                "description": self.description}


def parse_device(spec: str) -> DeviceTarget:
    """``--device`` of ``pagellm plan`` -> the memory to plan for."""
    from pagellm.config import parse_size
    from pagellm.memory_plan import available_host_memory

    text = spec.strip().lower()
    if text == "auto":
        import torch

        text = spec = "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return DeviceTarget(spec, "cpu", available_host_memory(), "this host")
    if text == "cuda" or text.startswith("cuda:"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec}: no CUDA device on this machine; name the target "
                             f"instead ({', '.join(GPU_MEMORY_MIB)}) or give its memory "
                             "(e.g. 80GiB).")
        _, total = torch.cuda.mem_get_info(torch.device(text))
        return DeviceTarget(spec, "cuda", int(total), torch.cuda.get_device_name(text))
    if text in GPU_MEMORY_MIB:
        mib, description = GPU_MEMORY_MIB[text]
        return DeviceTarget(spec, "cuda", mib * MiB, description)
    if text[:1].isdigit():
        return DeviceTarget(spec, "cuda", int(parse_size(text, "--device") or 0),
                            f"a GPU with {spec}")
    raise ValueError(f"--device {spec!r}: use cpu, cuda[:N], a GPU name "
                     f"({', '.join(GPU_MEMORY_MIB)}) or a GPU memory size such as 80GiB.")


def estimate_activation_bytes(spec: ModelSpec, dtype_bytes: int, tp: int,
                              max_num_batched_tokens: int, max_num_seqs: int) -> int:
    t, b = max_num_batched_tokens, dtype_bytes
    rows = min(t, max_num_seqs)
    mlp = t * (2 * spec.hidden_size + 4 * (spec.intermediate_size // tp)) * b
    logits = rows * spec.vocab_size * (b + 4) + t * spec.hidden_size * b
    return max(mlp, logits)


def estimate_overhead_bytes(kind: str, tp: int) -> int:
    if kind != "cuda":
        return 0
    return CUDA_CONTEXT_BYTES + (NCCL_BYTES if tp > 1 else 0)
