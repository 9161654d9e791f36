"""examples/grpo.py in a short form on a tiny random model: it runs, logs one mean reward per
step, pushes the trainer's weights into pagellm, and saves a folder pagellm can load."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

from pagellm import LLM, SamplingParams

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo.py"


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_example_short_run(tiny_llama_dir, tmp_path, monkeypatch) -> None:
    grpo = load_example()
    # A random model never answers a sum: every reward would be 0 and no gradient would flow.
    # Rewards that differ within each group make the steps really move the weights.
    rng = random.Random(0)
    monkeypatch.setattr(grpo, "reward", lambda text, target: rng.random())
    model_dir = tiny_llama_dir
    out = tmp_path / "out"
    # A large lr so that one step visibly moves the random model's greedy tokens.
    args = grpo.parse_args(["--model", str(model_dir), "--steps", "2", "--prompts-per-step", "2",
                            "--group-size", "2", "--max-tokens", "8", "--lr", "1e-2",
                            "--out", str(out), "--seed", "0"])
    llm, policy, rewards = grpo.train(args)
    assert len(rewards) == 2
    assert all(0.0 <= r <= 1.0 for r in rewards)
    assert json.loads((out / "rewards.json").read_text()) == rewards
    assert (out / "config.json").exists() and list(out.glob("*.safetensors"))

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 42, 99, 7, 3]}, "What is 3 + 4?"]
    trained = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    # The saved folder loads, and gives what the engine holds after the last weight push.
    fresh = LLM(model=str(out), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    assert [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy, use_tqdm=False)] \
        == trained
    base = LLM(model=str(model_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    assert [o.outputs[0].token_ids for o in base.generate(prompts, greedy, use_tqdm=False)] \
        != trained  # the run did change the weights
    assert policy.config.vocab_size == fresh.llm_engine.config.model.vocab_size
