"""GRPO with TRL's GRPOTrainer, pagellm generating the rollouts.

The same task as examples/grpo.py ("What is a + b?", answered tersely: reward 2 for the bare
answer, 1 if the right sum appears). TRL runs the training: grouping, advantages, its loss
(``dapo`` by default), the optimizer, logging. pagellm plugs in at two points:

- ``rollout_func`` (an experimental GRPOTrainer argument of TRL >= 0.24): TRL hands it the
  batch's prompts (each one repeated ``num_generations`` times, in a row); pagellm samples a
  group per distinct prompt (``SamplingParams(n=num_generations, logprobs=0)``) and returns
  the prompt ids, completion ids and sampled-token log-probs TRL expects.
- a ``TrainerCallback.on_step_end``: after each optimizer step it pushes the trainer's weights
  into pagellm with ``llm.load_weights``, so the next rollouts come from the updated policy.

    .venv/bin/python examples/grpo_trl.py --steps 20 --out /tmp/grpo-trl-out
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from pagellm import LLM, SamplingParams


def load_grpo_example() -> ModuleType:
    """examples/grpo.py, for its task (prompts, reward) and the default model's HF folder."""
    path = Path(__file__).resolve().with_name("grpo.py")
    spec = importlib.util.spec_from_file_location("pagellm_grpo_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GRPO = load_grpo_example()


def group_runs(prompts: list[Any]) -> list[tuple[Any, int]]:
    """Consecutive equal prompts as (prompt, count): TRL's sampler repeats each prompt
    ``num_generations`` times in a row, and one request with ``n=count`` samples the group."""
    runs: list[tuple[Any, int]] = []
    for prompt in prompts:
        if runs and runs[-1][0] == prompt:
            runs[-1] = (prompt, runs[-1][1] + 1)
        else:
            runs.append((prompt, 1))
    return runs


class PagellmRollout:
    """TRL's ``rollout_func(prompts, trainer) -> dict``, backed by a pagellm engine."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.seconds = 0.0  # time spent generating, for the log

    def sampling_params(self, args: Any, n: int) -> SamplingParams:
        # TRL's own generation options, so that none of them is silently dropped.
        fields: dict[str, Any] = dict(
            n=n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or 0,
            min_p=args.min_p or 0.0, repetition_penalty=args.repetition_penalty,
            max_tokens=args.max_completion_length, logprobs=0, detokenize=False)
        fields.update(args.generation_kwargs or {})  # unknown keys: TypeError from SamplingParams
        return SamplingParams(**fields)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        t0 = time.perf_counter()
        tok = trainer.processing_class
        runs = group_runs(prompts)
        requests = []
        for prompt, _ in runs:
            if isinstance(prompt, str):
                ids = tok(prompt, add_special_tokens=False)["input_ids"]
            else:  # conversational: the chat template is applied here, at the backend
                ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                              return_dict=False, **trainer.chat_template_kwargs)
            requests.append({"prompt_token_ids": list(ids)})
        # One call: every group is batched together; params differ only in n.
        params = [self.sampling_params(trainer.args, n) for _, n in runs]
        outputs = self.llm.generate(requests, params, use_tqdm=False)

        prompt_ids, completion_ids, logprobs = [], [], []
        for out in outputs:
            for c in out.outputs:
                prompt_ids.append(list(out.prompt_token_ids))
                completion_ids.append(list(c.token_ids))
                logprobs.append([lp[t].logprob for lp, t in
                                 zip(c.logprobs, c.token_ids, strict=True)])
        self.seconds += time.perf_counter() - t0
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def make_weight_push_callback(llm: LLM) -> Any:
    from transformers import TrainerCallback

    class PushWeightsToPagellm(TrainerCallback):
        """After every optimizer step, the engine takes the trainer's new weights."""

        def __init__(self) -> None:
            self.pushes = 0
            self.seconds = 0.0

        def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
            t0 = time.perf_counter()
            with torch.no_grad():
                llm.load_weights(model.named_parameters())
            self.pushes += 1
            self.seconds += time.perf_counter() - t0

    return PushWeightsToPagellm()


def sum_reward(completions: list[Any], target: list[int], **_: Any) -> list[float]:
    """TRL reward function: ``target`` is the dataset column of the same name."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [GRPO.reward(text, t) for text, t in zip(texts, target, strict=True)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8, help="TRL's num_generations")
    ap.add_argument("--max-tokens", type=int, default=16, help="TRL's max_completion_length")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="pagellm's dtype for the rollouts (the trainer stays float32)")
    ap.add_argument("--out", default="grpo-trl-out")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def train(args: argparse.Namespace) -> tuple[LLM, Any, list[float]]:
    """Run TRL's GRPOTrainer; returns the engine, the trainer and the mean reward of each step."""
    import random

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model_dir = args.model or GRPO.default_hf_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    rows = []
    for _ in range(args.steps * args.prompts_per_step):
        question, target = GRPO.make_prompt(rng)
        rows.append({"prompt": [{"role": "user", "content": question}], "target": target})

    config = GRPOConfig(
        output_dir=str(Path(args.out) / "trainer"), max_steps=args.steps,
        per_device_train_batch_size=args.prompts_per_step * args.group_size,
        num_generations=args.group_size, max_completion_length=args.max_tokens,
        temperature=args.temperature, learning_rate=args.lr, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, bf16=False, seed=args.seed,
        data_seed=args.seed, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True,
        gradient_checkpointing=False)  # TRL turns it on; a 135M model needs no memory saving
    llm = LLM(model=model_dir, dtype=args.dtype, seed=args.seed, kv_cache_memory="256MiB",
              max_model_len=256, enable_prefix_caching=True)
    rollout = PagellmRollout(llm)
    push = make_weight_push_callback(llm)
    with warnings.catch_warnings():  # TRL warns that rollout_func is experimental: we know
        warnings.filterwarnings("ignore", message=".*'rollout_func'.*experimental")
        trainer = GRPOTrainer(model=policy, reward_funcs=sum_reward, args=config,
                              train_dataset=Dataset.from_list(rows), processing_class=tok,
                              rollout_func=rollout, callbacks=[push])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0

    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    for step, r in enumerate(rewards):
        print(f"step {step:3d}  mean reward {r:.3f}")
    print(f"{len(rewards)} steps in {wall:.0f} s: rollouts {rollout.seconds:.0f} s, "
          f"{push.pushes} weight pushes {push.seconds:.1f} s")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    trainer.model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    (out_dir / "rewards.json").write_text(json.dumps(rewards))
    GRPO.plot(rewards, out_dir / "rewards.png")
    return llm, trainer, rewards


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _, _, rewards = train(args)
    print(f"mean reward: first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}; "
          f"model, rewards.json and rewards.png in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
