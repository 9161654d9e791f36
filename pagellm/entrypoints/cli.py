"""The ``pagellm`` command: generate, chat, serve, bench, plan, warmup."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from pagellm.engine_args import EngineArgs


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling_params(ns: argparse.Namespace) -> Any:
    from pagellm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, min_p=ns.min_p, seed=ns.sampling_seed, stop=ns.stop,
                          ignore_eos=ns.ignore_eos)


def _stream(engine: Any, request_id: str, prompt: Any, params: Any) -> str:
    """Run one request, printing text as it is produced; returns the full text."""
    from pagellm.engine.output_processor import OutputKind

    engine.add_request(request_id, prompt, params, kind=OutputKind.DELTA)
    pieces: list[str] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            piece = out.outputs[0].text
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(pieces)


def run_generate(ns: argparse.Namespace) -> int:
    from pagellm.engine.llm_engine import LLMEngine

    prompts = ns.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: give prompts as arguments or on stdin", file=sys.stderr)
        return 2
    params = _sampling_params(ns)
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))
    for i, prompt in enumerate(prompts):
        if ns.chat:
            ids = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
            prompt = {"prompt_token_ids": list(_ids(ids))}
        _stream(engine, f"gen-{i}", prompt, params)
    return 0


def _ids(ids: Any) -> list[int]:
    return list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)


def run_chat(ns: argparse.Namespace) -> int:
    from pagellm.engine.llm_engine import LLMEngine

    params = _sampling_params(ns)
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))
    messages: list[dict[str, str]] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    print("pagellm chat — empty line or Ctrl-D to quit, /reset to clear the conversation.")
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            messages = messages[:1] if ns.system else []
            continue
        messages.append({"role": "user", "content": line})
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=True)
        reply = _stream(engine, f"chat-{turn}", {"prompt_token_ids": _ids(ids)}, params)
        messages.append({"role": "assistant", "content": reply})
        turn += 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description="pagellm: LLM inference engine")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts (arguments or stdin)")
    gen.add_argument("prompts", nargs="*", help="prompts (default: one per stdin line)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    EngineArgs.add_cli_args(gen, model_positional=False)
    _add_sampling_args(gen, max_tokens=64)
    gen.set_defaults(func=run_generate)

    chat = sub.add_parser("chat", help="interactive chat with the model")
    chat.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=run_chat)

    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub: Any) -> None:
    """Commands that live in their own modules."""
    from pagellm.benchmarks.cli import add_bench_parser
    from pagellm.entrypoints.warmup import add_warmup_parser

    add_bench_parser(sub)
    add_warmup_parser(sub)
    try:
        from pagellm.entrypoints.openai.cli_serve import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)
    try:
        from pagellm.planning.cli import add_plan_parser
    except ImportError:
        pass
    else:
        add_plan_parser(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    start = time.perf_counter()
    try:
        return int(ns.func(ns) or 0)
    except ValueError as e:
        # Configuration and input errors: one clear line naming the flag, no traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        logging.getLogger("pagellm").debug("done in %.1f s", time.perf_counter() - start)


if __name__ == "__main__":
    sys.exit(main())
