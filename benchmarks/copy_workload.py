"""A copy-heavy workload for speculative decoding: edit a given text, complete a given file.

usage: python benchmarks/copy_workload.py OUT.jsonl [--num-requests 16] [--max-tokens 256]
       [--tokenizer DIR]

Writes ``{"prompt_token_ids": [...], "max_tokens": N}`` lines (the format of
``pagellm bench throughput --dataset``) built from this repository's own Python files, half of
each kind, deterministic:
- ``edit``: a chat turn "here is a file, rewrite it in full with one change" (what an editing
  assistant sees; the answer repeats most of the prompt);
- ``complete``: the first 60% of a file as a plain prompt, to be continued (code completion).
Prompts are cut to ~1,200 tokens. The tokenizer is the default model's unless ``--tokenizer``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_SOURCE_CHARS = 3600  # ~1,200 tokens of Python


def source_files() -> list[Path]:
    return sorted(p for p in (REPO / "pagellm").rglob("*.py")
                  if p.stat().st_size > 2000 and "__init__" not in p.name)


def edit_prompt(tok, text: str) -> list[int]:
    msgs = [{"role": "user", "content": "Here is a Python file:\n```python\n" + text
             + "\n```\nRewrite this file in full, changing nothing except adding a short "
             "comment at the top."}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tokenizer", default=None)
    ns = ap.parse_args()
    from pagellm.models.loader import load_tokenizer, resolve_model_source

    tok = load_tokenizer(resolve_model_source(None), ns.tokenizer)
    files = source_files()
    with open(ns.out, "w", encoding="utf-8") as f:
        for i in range(ns.num_requests):
            text = files[(i // 2) % len(files)].read_text(encoding="utf-8")[:MAX_SOURCE_CHARS]
            if i % 2 == 0:
                ids = edit_prompt(tok, text)
            else:
                ids = tok(text[: int(len(text) * 0.6)])["input_ids"]
            ids = list(ids)
            f.write(json.dumps({"prompt_token_ids": ids, "max_tokens": ns.max_tokens}) + "\n")
    print(f"wrote {ns.num_requests} requests to {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
