"""Engine configuration: the frozen ``EngineConfig`` an engine runs with, the allowed values of
its options, and the checks shared by the engine and `pagellm plan`.

``pagellm.engine_args.EngineArgs`` (the options as the user gives them, vLLM's names) builds it
with ``create_engine_config()``; nothing mutates it afterwards. Environment variables are read
here only (``read_env``; the engine keeps what it started with in ``EngineConfig.env``). This
module imports nothing else of pagellm, so every part may import it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("pagellm")

# The allowed values of the engine's flags: the flags' choices and create_engine_config's checks.
DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
               "half": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16",
               "fp16": "float16"}  # --dtype's aliases -> torch dtype names
DTYPES = ("auto", *DTYPE_NAMES)
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
PREFIX_CACHING_HASH_ALGOS = ("sha256", "blake2b")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
SCHEDULING_POLICIES = ("fcfs", "priority")
# Both mean xgrammar today ("auto" leaves room for more); llguidance ("guidance") is not
# installed here, so it is not offered.
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)  # checked, not argparse choices: the error names the flag
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


_OFF = ("0", "false", "no", "off")
CPU_ISAS = ("native", "avx512-bf16", "avx512", "generic")


@dataclass(frozen=True)
class EnvSettings:
    """Every environment variable pagellm reads, read here only (``read_env``); the engine keeps
    the values it started with in ``EngineConfig.env``, so each process does the same."""

    cpu_kernels: bool = True  # PAGELLM_CPU_KERNELS=0: plain PyTorch paths on CPU
    cpu_isa: str = "native"  # PAGELLM_CPU_ISA: the newest kernel path built (CPU_ISAS)
    cxx: str | None = None  # CXX: the compiler for the CPU kernels
    fused_cpu: bool = True  # PAGELLM_FUSED_CPU=0: no fused one-call CPU step
    cache_dir: str | None = None  # PAGELLM_CACHE_DIR
    xdg_cache_home: str | None = None  # XDG_CACHE_HOME
    gguf_cache: bool = True  # PAGELLM_NO_GGUF_CACHE=1: convert GGUF files in memory each start
    allow_long_max_model_len: bool = False  # PAGELLM_ALLOW_LONG_MAX_MODEL_LEN
    fault_inject: str = ""  # PAGELLM_FAULT_INJECT (tests only; see engine/fault_injection.py)
    triton_interpret: bool = False  # TRITON_INTERPRET=1: Triton kernels on the CPU (tests)
    api_key: str | None = None  # PAGELLM_API_KEY
    admin_api_key: str | None = None  # PAGELLM_ADMIN_API_KEY
    openai_api_key: str | None = None  # OPENAI_API_KEY (`pagellm bench serve`'s fallback)
    # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (else OTEL_EXPORTER_OTLP_PROTOCOL): how
    # --otlp-traces-endpoint exports, grpc (default, as vLLM) or http/protobuf
    otlp_traces_protocol: str = "grpc"
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: KV events carry the 32-byte block digests instead
    # of vLLM's default 64-bit integers (engine/kv_events.py)
    kv_events_int_block_hashes: bool = True


def read_env(environ: Any = None) -> EnvSettings:
    """The environment's settings now (``environ`` defaults to ``os.environ``)."""
    env = os.environ if environ is None else environ

    def flag(name: str, default: str) -> bool:
        return env.get(name, default).strip().lower() not in _OFF

    isa = env.get("PAGELLM_CPU_ISA", "native").strip().lower() or "native"
    if isa not in CPU_ISAS:
        raise ValueError(f"PAGELLM_CPU_ISA must be one of {', '.join(CPU_ISAS)}, got {isa!r}.")
    return EnvSettings(
        cpu_kernels=flag("PAGELLM_CPU_KERNELS", "1"),
        cpu_isa=isa,
        cxx=env.get("CXX") or None,
        fused_cpu=flag("PAGELLM_FUSED_CPU", "1"),
        cache_dir=env.get("PAGELLM_CACHE_DIR") or None,
        xdg_cache_home=env.get("XDG_CACHE_HOME") or None,
        gguf_cache=env.get("PAGELLM_NO_GGUF_CACHE", "") in ("", "0"),
        allow_long_max_model_len=bool(env.get("PAGELLM_ALLOW_LONG_MAX_MODEL_LEN")),
        fault_inject=env.get("PAGELLM_FAULT_INJECT", "").strip(),
        triton_interpret=env.get("TRITON_INTERPRET", "0") == "1",
        api_key=env.get("PAGELLM_API_KEY") or None,
        admin_api_key=env.get("PAGELLM_ADMIN_API_KEY") or None,
        openai_api_key=env.get("OPENAI_API_KEY") or None,
        otlp_traces_protocol=(env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                              or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip(),
        kv_events_int_block_hashes=flag("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1"),
    )


# The variables that hold API keys (EnvSettings.api_key, .admin_api_key).
API_KEY_ENV_VARS = ("PAGELLM_API_KEY", "PAGELLM_ADMIN_API_KEY")


def child_environ(overrides: Mapping[str, str] | None = None, without: tuple[str, ...] = ()
                  ) -> dict[str, str]:
    """This process's environment with ``overrides`` and less ``without``, for a child process
    (a replica)."""
    env = {k: v for k, v in os.environ.items() if k not in without}
    return {**env, **(overrides or {})}


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
    # pagellm.models.generation_config.GenerationConfig: extra EOS ids, sampling defaults
    generation_config: Any = None

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

    def kv_cache_layout(self) -> Any:
        """The KV cache groups of the model's layers (core/kv_cache_groups.KVCacheLayout): by
        attention type, from the model class's ``layer_sliding_windows``."""
        from pagellm.core.kv_cache_groups import kv_cache_layout
        from pagellm.models.registry import get_model_cls

        model_cls: Any = get_model_cls(self.hf_config)
        return kv_cache_layout(model_cls.layer_sliding_windows(self.hf_config),
                               model_cls.recurrent_layers(self.hf_config))

    def recurrent_state_shapes(self, tp_size: int) -> list[tuple[tuple[int, ...], bool]]:
        """Per recurrent layer (all alike), the state tensors of one slot on one TP rank:
        ``(shape, float32)``, float32 False meaning the model's dtype (worker/state_cache.py);
        empty for models without recurrent layers."""
        from pagellm.models.registry import get_model_cls

        model_cls: Any = get_model_cls(self.hf_config)
        return list(model_cls.recurrent_state_shapes(self.hf_config, tp_size))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    kv_cache_memory: int | None  # bytes (CPU budget); None = default
    gpu_memory_utilization: float
    num_gpu_blocks_override: int | None
    cache_dtype: str = "auto"  # --kv-cache-dtype (pagellm/kv_cache_dtype.py)

    @property
    def kv_cache_dtype(self) -> Any:
        """The resolved --kv-cache-dtype (pagellm.kv_cache_dtype.KVCacheDtype)."""
        from pagellm.kv_cache_dtype import parse_kv_cache_dtype

        return parse_kv_cache_dtype(self.cache_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"  # or "priority" (see core/request_queue.py)
    # Schedule step N+1 while step N runs (EngineCore.step; docs/performance.md).
    async_scheduling: bool = False
    # vLLM's long_prefill_token_threshold: the most tokens one request gets in a step while
    # other requests are scheduled too (0: no cap beyond the budget; core/scheduler.py).
    long_prefill_token_threshold: int = 0


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    # Data parallelism (vLLM's names; engine/data_parallel.py): data_parallel_size engines, each
    # with its own KV cache and TP group. data_parallel_rank: this engine's rank, which is its
    # index in metrics and KV events (a server's front end holds rank 0 unless external).
    # data_parallel_external_lb (--data-parallel-rank): this server runs that one rank only.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_external_lb: bool = False

    @property
    def engine_ranks(self) -> tuple[int, ...]:
        """The data-parallel ranks a server with this config runs an engine for."""
        if self.data_parallel_external_lb:
            return (self.data_parallel_rank,)
        return tuple(range(self.data_parallel_size))


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
    enable_sleep_mode: bool = False  # LLM.sleep()/wake_up() allowed
    disable_log_stats: bool = False
    structured_outputs_backend: str = "auto"  # STRUCTURED_OUTPUTS_BACKENDS
    # pagellm.spec_decode.config.SpeculativeConfig (--speculative-config), or None: off.
    speculative_config: Any = None
    # pagellm.kv_events_config.KVEventsConfig (--kv-events-config), or None: no KV events.
    kv_events_config: Any = None
    # --logits-processors: plugin class names (sample/logits_processors.py), loaded by the
    # model runner that samples.
    logits_processors: tuple[str, ...] = ()
    env: EnvSettings = EnvSettings()  # the environment's settings when the config was made

    @property
    def num_state_slots(self) -> int:
        """Recurrent-state slots (core/state_slots.py): one per running sequence for a model
        with recurrent layers, 0 otherwise."""
        if not self.model.kv_cache_layout().state_layers:
            return 0
        return self.scheduler.max_num_seqs


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

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    if dtype != "auto":
        return getattr(torch, DTYPE_NAMES[dtype])
    if device.type == "cuda":
        cfg = hf_config_dtype(hf_config)
        chosen = torch.float16 if cfg in (torch.float16, "float16") else torch.bfloat16
        why = "half precision on CUDA"
    elif _cpu_has_fast_bf16():
        chosen, why = torch.bfloat16, "this CPU has native bf16 matmuls (AMX/AVX512-BF16)"
    else:
        chosen, why = torch.float32, "this CPU has no native bf16, so fp32 is faster and exact"
    logger.info("dtype auto -> %s (%s)", str(chosen).removeprefix("torch."), why)
    return chosen


def hf_config_dtype(hf_config: Any) -> Any:
    """The checkpoint's dtype from a transformers config, or None. transformers >= 4.56 names
    it ``dtype``; in 5.x reading the old ``torch_dtype`` name logs a deprecation warning at
    every start, so that name is read only where it is a plain attribute (older versions)."""
    dtype = getattr(hf_config, "dtype", None)
    if dtype is None:
        dtype = vars(hf_config).get("torch_dtype") if hasattr(hf_config, "__dict__") else None
    return dtype


def model_context_len(hf_config: Any) -> int:
    """The context length a model's config declares (2048 where it declares none)."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def attention_backend_unavailable(name: str, device: torch.device,
                                  env: EnvSettings | None = None) -> bool:
    if name == "cpu":
        return device.type != "cpu"
    if name != "triton":
        return False
    if device.type == "cuda":
        return False
    return not (env or read_env()).triton_interpret


def check_model_shape(hf_config: Any) -> None:
    """Refuse a model config whose attention heads the engine cannot group: every size positive,
    the query heads whole groups of the kv heads (GQA)."""
    heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"the model's config.json has num_attention_heads {heads} and num_key_value_heads "
            f"{kv_heads}: each must be >= 1 and the query heads a whole multiple of the kv "
            "heads.")


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
