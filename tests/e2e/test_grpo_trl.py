"""examples/grpo_trl.py in a short form on a tiny random model: TRL's GRPOTrainer takes pagellm's
rollouts through ``rollout_func``, and the trainer's weights reach pagellm after every step."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams

pytest.importorskip("trl")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_trl.py"


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_trl_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_group_runs_keeps_trl_order() -> None:
    grpo_trl = load_example()
    a, b = [{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]
    assert grpo_trl.group_runs([a, a, a, b, b, a]) == [(a, 3), (b, 2), (a, 1)]


def test_grpo_trl_short_run(tiny_llama_dir, tmp_path, monkeypatch) -> None:
    grpo_trl = load_example()
    # A random model never answers a sum: all-zero rewards would give no gradient.
    rng = random.Random(0)
    monkeypatch.setattr(grpo_trl.GRPO, "reward", lambda text, target: rng.random())
    out = tmp_path / "out"
    args = grpo_trl.parse_args(["--model", str(tiny_llama_dir), "--steps", "2",
                                "--prompts-per-step", "2", "--group-size", "3",
                                "--max-tokens", "8", "--lr", "1e-2", "--out", str(out)])
    llm, trainer, rewards = grpo_trl.train(args)
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
    assert json.loads((out / "rewards.json").read_text()) == rewards
    push = next(c for c in trainer.callback_handler.callbacks if hasattr(c, "pushes"))
    assert push.pushes == 2  # one weight push per optimizer step

    # The rollout contract, against transformers on the trainer's current weights: one
    # completion per (repeated) prompt, in TRL's order, with the sampled tokens' log-probs.
    rollout = trainer.rollout_func
    q1, q2 = ([{"role": "user", "content": f"What is {a} + 1?"}] for a in (3, 4))
    got = rollout([q1, q1, q1, q2, q2, q2], trainer)
    assert len(got["completion_ids"]) == 6 and len(got["logprobs"]) == 6
    tok = trainer.processing_class
    want_prompt = tok.apply_chat_template(q2, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
    assert got["prompt_ids"][3:] == [list(want_prompt)] * 3
    assert all(0 < len(c) <= 8 for c in got["completion_ids"])
    with torch.no_grad():
        ref = grpo_trl.GRPO.completion_logprobs(trainer.model.eval(), got["prompt_ids"],
                                                got["completion_ids"], tok.pad_token_id)
    for engine_lp, ref_lp in zip(got["logprobs"], ref, strict=True):
        torch.testing.assert_close(torch.tensor(engine_lp), ref_lp, atol=2e-4, rtol=0)

    # The engine holds the trained weights: it generates what a fresh engine on the saved
    # folder does, and not what the base model does.
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 42, 99, 7, 3]}, "What is 3 + 4?"]
    trained = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    fresh = LLM(model=str(out), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    assert [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy, use_tqdm=False)] \
        == trained
    base = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB",
               max_model_len=256)
    assert [o.outputs[0].token_ids for o in base.generate(prompts, greedy, use_tqdm=False)] \
        != trained
