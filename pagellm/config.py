"""Engine configuration: every engine flag in one place, validated once.

``EngineArgs`` mirrors the CLI (vLLM's flag names). ``EngineArgs.create_engine_config()`` loads the
model's config (no weights), resolves "auto" values and checks everything, returning a frozen
``EngineConfig``. Nothing mutates the config afterwards. Environment variables are read here only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("pagellm")

_DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float", "fp32", "bf16", "fp16")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class ModelConfig:
    model: str | None  # as given (None = the default model)
    source: Any  # pagellm.models.loader.ModelSource
    hf_config: Any  # transformers.PretrainedConfig
    tokenizer: str | None
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    seed: int
    served_model_name: str
    quantization: str | None = None  # normalized --quantization ("int8", "int4-g128"), or None

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or ["LlamaForCausalLM"]
        return archs[0]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        n = getattr(self.hf_config, "num_key_value_heads", None)
        return int(n or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        hd = getattr(self.hf_config, "head_dim", None)
        return int(hd or self.hf_config.hidden_size // self.num_attention_heads)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    kv_cache_memory: int | None  # bytes (CPU budget); None = default
    gpu_memory_utilization: float
    num_gpu_blocks_override: int | None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"  # or "priority" (see core/request_queue.py)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device
    attention_backend: str


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    enforce_eager: bool = False
    disable_log_stats: bool = False


def parse_size(value: str | int | float | None, flag: str = "--kv-cache-memory") -> int | None:
    """'4GiB', '512MiB', '2G', '1.5GB', or a byte count -> bytes."""
    if value is None or value == "":
        return None
    if isinstance(value, int | float):
        if value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}.")
        return int(value)
    text = str(value).strip().lower().replace(" ", "")
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10, "tb": 10**12, "gb": 10**9,
             "mb": 10**6, "kb": 10**3, "t": 2**40, "g": 2**30, "m": 2**20, "k": 2**10, "b": 1}
    unit = next((u for u in units if text.endswith(u)), "")
    number, mult = (text[: -len(unit)], units[unit]) if unit else (text, 1)
    try:
        size = int(float(number) * mult)
    except ValueError:
        raise ValueError(f"{flag}: cannot read {value!r} as a size (e.g. 4GiB, 512MiB).") from None
    if size <= 0:
        raise ValueError(f"{flag} must be positive, got {value!r}.")
    return size


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine.")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda[:N], got {device!r}.")
    return torch.device(device)


def _cpu_has_fast_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str, hf_config: Any, device: torch.device) -> torch.dtype:
    import torch

    names = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}.")
    if dtype != "auto":
        return names[dtype]
    if device.type == "cuda":
        cfg = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
        chosen = torch.float16 if cfg in (torch.float16, "float16") else torch.bfloat16
        why = "half precision on CUDA"
    elif _cpu_has_fast_bf16():
        chosen, why = torch.bfloat16, "this CPU has native bf16 matmuls (AMX/AVX512-BF16)"
    else:
        chosen, why = torch.float32, "this CPU has no native bf16, so fp32 is faster and exact"
    logger.info("dtype auto -> %s (%s)", str(chosen).removeprefix("torch."), why)
    return chosen


def _model_context_len(hf_config: Any) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


@dataclass
class EngineArgs:
    """Every engine option, spelled as vLLM spells it (CLI flags are the same with dashes)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory: str | int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = False
    prefix_caching_hash_algo: str = "sha256"
    tensor_parallel_size: int = 1
    seed: int = 0
    device: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False
    served_model_name: str | None = None
    disable_log_stats: bool = False
    scheduling_policy: str = "fcfs"
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"extra"}

    def create_engine_config(self) -> EngineConfig:
        from pagellm.models.loader import load_hf_config, resolve_model_source

        check_cache_flags(self)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got "
                             f"{self.tensor_parallel_size}.")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError("--load-format must be auto, safetensors, gguf or dummy, "
                             f"got {self.load_format!r}.")
        if self.prefix_caching_hash_algo not in ("sha256", "blake2b"):
            raise ValueError("--prefix-caching-hash-algo must be sha256 or blake2b, "
                             f"got {self.prefix_caching_hash_algo!r}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("--scheduling-policy must be fcfs or priority, "
                             f"got {self.scheduling_policy!r}.")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError("--attention-backend must be auto, cpu, torch or triton, "
                             f"got {self.attention_backend!r}.")
        from pagellm.layers.quantization import parse_quantization

        quant = parse_quantization(self.quantization)  # ValueError names --quantization
        device = resolve_device(self.device)
        source = resolve_model_source(self.model)
        hf_config = load_hf_config(source)
        dtype = resolve_dtype(self.dtype, hf_config, device)
        check_tensor_parallel(self.tensor_parallel_size, hf_config, device, self.device)

        max_model_len, max_num_seqs, max_num_batched_tokens = resolve_scheduler_limits(
            self, _model_context_len(hf_config))

        model_name = self.served_model_name or (self.model or "SmolLM2-135M-Instruct")
        if attention_backend_unavailable(self.attention_backend, device):
            raise ValueError(f"--attention-backend {self.attention_backend} "
                             + ("runs on CPU devices only." if self.attention_backend == "cpu"
                                else "needs a CUDA device and the triton package (or "
                                "TRITON_INTERPRET=1 for testing)."))
        return EngineConfig(
            model=ModelConfig(
                model=self.model, source=source, hf_config=hf_config, tokenizer=self.tokenizer,
                dtype=dtype, max_model_len=max_model_len, load_format=self.load_format,
                seed=self.seed, served_model_name=model_name,
                quantization=quant.name if quant is not None else None),
            cache=CacheConfig(
                block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                kv_cache_memory=parse_size(self.kv_cache_memory),
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len, policy=self.scheduling_policy),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            device=DeviceConfig(device=device, attention_backend=self.attention_backend),
            enforce_eager=self.enforce_eager,
            disable_log_stats=self.disable_log_stats,
        )


def check_cache_flags(args: EngineArgs) -> None:
    """--block-size and --gpu-memory-utilization; shared by the engine and `pagellm plan`."""
    if args.block_size not in (1, 8, 16, 32, 64, 128):
        raise ValueError(f"--block-size must be one of 1, 8, 16, 32, 64, 128, "
                         f"got {args.block_size}.")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError("--gpu-memory-utilization must be in (0, 1], "
                         f"got {args.gpu_memory_utilization}.")


def resolve_scheduler_limits(args: EngineArgs, context_len: int) -> tuple[int, int, int]:
    """(max_model_len, max_num_seqs, max_num_batched_tokens) with defaults applied and checked;
    shared by the engine and `pagellm plan` so both accept and refuse the same flags."""
    max_model_len = args.max_model_len or context_len
    if max_model_len < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {max_model_len}.")
    if max_model_len > context_len and not os.environ.get("PAGELLM_ALLOW_LONG_MAX_MODEL_LEN"):
        raise ValueError(
            f"--max-model-len {max_model_len} is larger than the model's context length "
            f"({context_len}). Lower --max-model-len, or set "
            "PAGELLM_ALLOW_LONG_MAX_MODEL_LEN=1 if you know the model extrapolates.")
    batched = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    if batched < 1:
        raise ValueError(f"--max-num-batched-tokens must be >= 1, got {batched}.")
    # Unset, the sequence limit follows a small token budget down instead of failing.
    max_num_seqs = args.max_num_seqs or min(DEFAULT_MAX_NUM_SEQS, batched)
    if max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {max_num_seqs}.")
    if batched < max_num_seqs:
        # Every running request needs one token per step for decode.
        raise ValueError(
            f"--max-num-batched-tokens ({batched}) must be >= --max-num-seqs "
            f"({max_num_seqs}) so every running sequence can decode each step.")
    return max_model_len, max_num_seqs, batched


def attention_backend_unavailable(name: str, device: torch.device) -> bool:
    if name == "cpu":
        return device.type != "cpu"
    if name != "triton":
        return False
    if device.type == "cuda":
        return False
    return os.environ.get("TRITON_INTERPRET") != "1"


def check_tensor_parallel(tp: int, hf_config: Any, device: torch.device, device_flag: str,
                          num_cuda_devices: int | None = None) -> None:
    """Refuse a --tensor-parallel-size the model or the machine cannot be split over.

    Attention heads and the MLP width must divide evenly; K/V heads either divide over the ranks
    or, when there are fewer of them than ranks, are replicated (the ranks must then be a
    multiple of them). On CUDA each rank needs its own GPU (cuda:0 .. cuda:N-1).
    """
    if tp == 1:
        return
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    inter = getattr(hf_config, "intermediate_size", None)

    def fits(n: int) -> bool:
        kv_ok = kv_heads % n == 0 or n % kv_heads == 0
        return heads % n == 0 and kv_ok and (inter is None or int(inter) % n == 0)

    if not fits(tp):
        valid = [n for n in range(1, heads + 1) if fits(n)]
        raise ValueError(
            f"--tensor-parallel-size {tp} cannot split this model: it needs to divide "
            f"num_attention_heads ({heads}) and intermediate_size ({inter}), and to divide or be "
            f"a multiple of num_key_value_heads ({kv_heads}). Valid sizes: "
            f"{', '.join(map(str, valid))}.")
    if device.type == "cuda":
        import torch

        if device_flag not in ("auto", "cuda"):
            raise ValueError(f"--device {device_flag} with --tensor-parallel-size {tp}: rank r "
                             "runs on cuda:r; pass --device cuda and choose the GPUs with "
                             "CUDA_VISIBLE_DEVICES.")
        count = torch.cuda.device_count() if num_cuda_devices is None else num_cuda_devices
        if tp > count:
            raise ValueError(f"--tensor-parallel-size {tp} needs {tp} GPUs (one per rank), but "
                             f"{count} CUDA device(s) are visible.")
