"""Helpers shared by the load_weights tests (tests/engine, tests/distributed)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch

from pagellm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(vocab: int, n: int = 4, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(5, 60))]}
            for _ in range(n)]


def tokens(llm: LLM, ps: list[dict]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]


def perturbed_model(src: Path, dst: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """A trainer's model (transformers, from ``src``) after a "training step": every tensor
    moved; saved to ``dst`` as a checkpoint; returns its ``named_parameters()``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std().clamp_min(0.05) * 0.5)
    model.save_pretrained(dst, safe_serialization=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, dst / f.name)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint in ``path`` by their checkpoint names: what a trainer sends
    for a MoE model (transformers 5's ``named_parameters()`` stack the experts, its checkpoints
    keep one tensor per expert)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(load_file(f))
    return weights


def write_checkpoint(src: Path, dst: Path, weights: dict[str, torch.Tensor]) -> Path:
    """``src``'s config and tokenizer with ``weights`` as its single safetensors file."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, dst / f.name)
    save_file({n: t.contiguous() for n, t in weights.items()}, dst / "model.safetensors",
              metadata={"format": "pt"})
    return dst
