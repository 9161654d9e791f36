"""GRPO (group relative policy optimization) with pagellm generating the rollouts.

The task: "What is a + b?", answered briefly. A completion earns 1 if the right sum appears in
it, 2 if it is nothing but the answer (``12``, ``7 + 5 = 12.``): the model learns to be right and
terse, checked by a regex. Each step pagellm samples a group of completions
per prompt; the trainer (the same model in transformers) recomputes their token log-probs,
weighs them by group-normalized advantages, takes an AdamW step and pushes the new weights into
pagellm with ``llm.load_weights``: the next rollouts come from the updated policy.

One gradient step per batch of rollouts, so the policy that sampled is the one being trained:
the PPO-style ratio is 1 and its clipping never acts, and the loss is plain REINFORCE with the
group baseline. The KL penalty to a reference model is left out (small lr and few steps).

    .venv/bin/python examples/grpo.py --steps 20 --out /tmp/grpo-out
    pagellm serve /tmp/grpo-out
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch

from pagellm import LLM, SamplingParams

TERSE = re.compile(r"(?:\d+ ?\+ ?\d+ ?= ?)?(\d+)\.?")


def default_hf_dir() -> str:
    """The default model as an HF folder: pagellm's GGUF conversion cache holds one."""
    from pagellm.models import gguf_cache
    from pagellm.models.loader import resolve_model_source

    src = resolve_model_source(None)
    folder = gguf_cache.cached_folder(src.gguf_path, gguf_cache.WEIGHTS)
    if folder is None:  # the first LLM() converts the GGUF and writes the folder
        LLM(kv_cache_memory="64MiB", max_model_len=256)
        folder = gguf_cache.cached_folder(src.gguf_path, gguf_cache.WEIGHTS)
    return str(folder)


def make_prompt(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return f"What is {a} + {b}?", a + b


def reward(text: str, target: int) -> float:
    m = TERSE.fullmatch(text.strip())
    if m is not None and int(m.group(1)) == target:
        return 2.0
    return float(str(target) in re.findall(r"\d+", text))


def completion_logprobs(model: torch.nn.Module, prompt_ids: list[list[int]],
                        completion_ids: list[list[int]], pad_id: int) -> list[torch.Tensor]:
    """The log-prob of each completion token under ``model``, one tensor per sequence."""
    seqs = [p + c for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)  # position t predicts token t + 1
    out = []
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        targets = torch.tensor(c)
        rows = logp[i, len(p) - 1:len(p) - 1 + len(c)]
        out.append(rows.gather(1, targets[:, None]).squeeze(1))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="pagellm's dtype for the rollouts (the trainer stays float32)")
    ap.add_argument("--out", default="grpo-out")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def train(args: argparse.Namespace) -> tuple[LLM, torch.nn.Module, list[float]]:
    """Run GRPO; returns the engine, the trainer's model and the mean reward of each step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model_dir = args.model or default_hf_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    llm = LLM(model=model_dir, dtype=args.dtype, seed=args.seed, kv_cache_memory="256MiB",
              max_model_len=256)  # room for a short chat prompt and its answer
    params = SamplingParams(n=args.group_size, temperature=args.temperature,
                            max_tokens=args.max_tokens, logprobs=0)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    rewards_log: list[float] = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        tasks = [make_prompt(rng) for _ in range(args.prompts_per_step)]
        prompts = [{"prompt_token_ids": list(tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
            return_dict=False))} for q, _ in tasks]
        outputs = llm.generate(prompts, params, use_tqdm=False)

        prompt_ids, completion_ids, advantages, engine_logp = [], [], [], []
        step_rewards = []
        for out, (_, target) in zip(outputs, tasks, strict=True):
            r = torch.tensor([reward(c.text, target) for c in out.outputs])
            step_rewards += r.tolist()
            # Group-normalized advantage: better than the group's mean -> pushed up.
            adv = (r - r.mean()) / (r.std() + 1e-4)
            for c, a in zip(out.outputs, adv.tolist(), strict=True):
                if c.token_ids:
                    prompt_ids.append(out.prompt_token_ids)
                    completion_ids.append(list(c.token_ids))
                    advantages.append(a)
                    engine_logp.append([lp[t].logprob for lp, t in
                                        zip(c.logprobs, c.token_ids, strict=True)])

        logps = completion_logprobs(policy, prompt_ids, completion_ids, pad_id)
        # Token-level mean over the batch (as in DAPO / TRL's default): long completions
        # don't get a smaller weight per token.
        n_tokens = sum(len(lp) for lp in logps)
        loss = -sum(a * lp.sum() for a, lp in zip(advantages, logps, strict=True)) / n_tokens
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        # The engine sampled with the weights the trainer had: their log-probs agree (up to
        # the dtype), which shows the weight push of the previous step landed.
        drift = sum((torch.tensor(e) - lp.detach()).abs().sum().item()
                    for e, lp in zip(engine_logp, logps, strict=True)) / n_tokens
        with torch.no_grad():
            llm.load_weights(policy.named_parameters())

        mean_r = sum(step_rewards) / len(step_rewards)
        rewards_log.append(mean_r)
        print(f"step {step:3d}  mean reward {mean_r:.3f}  loss {loss.item():+.4f}  "
              f"|logp engine - trainer| {drift:.1e}  {time.perf_counter() - t0:.1f} s  "
              f"e.g. {outputs[0].outputs[0].text.strip()[:40]!r}", flush=True)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    (out_dir / "rewards.json").write_text(json.dumps(rewards_log))
    plot(rewards_log, out_dir / "rewards.png")
    return llm, policy, rewards_log


def plot(rewards: list[float], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (the rewards are in rewards.json)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(rewards)), rewards, marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (max 2)")
    ax.set_title("GRPO with pagellm rollouts")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _, _, rewards = train(args)
    print(f"mean reward: first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}; "
          f"model, rewards.json and rewards.png in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
