"""A Mixture-of-Experts model against a dense one with the same active parameters, on the same
``pagellm bench throughput`` workload; prints each result and the MoE/dense throughput ratio.

    .venv/bin/python benchmarks/moe_vs_dense.py
    .venv/bin/python benchmarks/moe_vs_dense.py --experts 8 --top-k 2 --hidden 1024 \
        --expert-width 1024 --layers 4 --num-prompts 32 --dtype bfloat16

Both models are random (``--load-format dummy``) and share every shape but the MLP: the MoE
layer has ``--experts`` experts of width ``--expert-width`` with top-``--top-k`` routing, the
dense MLP has width ``top_k * expert_width``, so each token multiplies by the same number of
weights (the router's ``H * E`` aside). The ratio shows what grouping by expert costs next to a
single pair of large matmuls. MoE layers run the fused kernel on CPU (kernels/cpu_moe.cpp; the
torch grouped path with ``PAGELLM_CPU_KERNELS=0``) and the grouped Triton GEMM on CUDA.
``-- --quantization int8`` (or int4) quantizes both models, experts included.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

_CORPUS = ["The quick brown fox jumps over the lazy dog.", "def forward(self, x): return x",
           "Paged attention stores keys and values in fixed-size blocks.", "0123456789 +-*/"]


def _tokenizer() -> Any:
    """A small byte-level BPE: the engine loads a tokenizer even for token-id prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


def _write_models(ns: argparse.Namespace, root: Path) -> tuple[Path, Path]:
    from transformers import MistralConfig, MixtralConfig

    tok = _tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=ns.hidden, num_hidden_layers=ns.layers,
                  num_attention_heads=ns.heads, num_key_value_heads=ns.heads,
                  max_position_embeddings=4096, sliding_window=None, tie_word_embeddings=False,
                  eos_token_id=tok.eos_token_id)
    moe = MixtralConfig(**common, intermediate_size=ns.expert_width,
                        num_local_experts=ns.experts, num_experts_per_tok=ns.top_k)
    moe.architectures = ["MixtralForCausalLM"]
    dense = MistralConfig(**common, intermediate_size=ns.top_k * ns.expert_width)
    dense.architectures = ["MistralForCausalLM"]
    paths = []
    for name, config in (("moe", moe), ("dense", dense)):
        path = root / name
        config.save_pretrained(path)
        tok.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def _bench(path: Path, ns: argparse.Namespace) -> dict[str, Any]:
    from pagellm.benchmarks.throughput import benchmark_throughput
    from pagellm.entrypoints.cli import build_parser

    args = build_parser().parse_args([
        "bench", "throughput", "--model", str(path), "--load-format", "dummy",
        "--dtype", ns.dtype, "--num-prompts", str(ns.num_prompts),
        "--input-len", ns.input_len, "--output-len", ns.output_len, "--warmup", "2",
        *ns.engine_args])
    return benchmark_throughput(args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--expert-width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", default="64-128")
    p.add_argument("--output-len", default="32")
    p.add_argument("engine_args", nargs=argparse.REMAINDER,
                   help="more `pagellm bench throughput` options, after --")
    ns = p.parse_args()
    ns.engine_args = [a for a in ns.engine_args if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        moe_path, dense_path = _write_models(ns, Path(tmp))
        results = {name: _bench(path, ns) for name, path in
                   (("dense", dense_path), ("moe", moe_path))}
    for name, r in results.items():
        print(f"{name:>5}: {r['output_tokens_per_s']:.1f} output tok/s, "
              f"{r['total_tokens_per_s']:.1f} total tok/s, {r['elapsed_s']:.2f} s "
              f"({r['num_requests']} requests, {r['device']}, {r['dtype']})")
    ratio = results["moe"]["total_tokens_per_s"] / results["dense"]["total_tokens_per_s"]
    print(f"MoE ({ns.experts} experts, top-{ns.top_k}) / dense throughput: {ratio:.2f}x")


if __name__ == "__main__":
    main()
