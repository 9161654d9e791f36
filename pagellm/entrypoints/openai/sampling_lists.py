"""Request checks of vLLM's list-valued sampling fields: bad_words, allowed_token_ids and
vllm_xargs (the limits that keep them cheap, and the 400s that name them)."""

from __future__ import annotations

from typing import Any

from pagellm.entrypoints.openai.limits import ServerLimits
from pagellm.entrypoints.openai.protocol import SamplingFields
from pagellm.entrypoints.openai.serving_errors import bad_request


def check_sampling_lists(req: SamplingFields, lim: ServerLimits, config: Any) -> None:
    """400 naming the field for a bad_words list past --max-bad-words / --max-stop-length,
    an allowed_token_ids id outside the vocabulary (vLLM refuses it too), or vllm_xargs on a
    server with no --logits-processors to read them (they would be ignored)."""
    if req.bad_words:
        if len(req.bad_words) > lim.max_bad_words:
            raise bad_request(f"bad_words has {len(req.bad_words)} words, more than "
                              f"{lim.max_bad_words} (--max-bad-words).", "bad_words")
        if any(len(w) > lim.max_stop_length for w in req.bad_words):
            raise bad_request(f"Each bad word must be at most {lim.max_stop_length} "
                              "characters (--max-stop-length).", "bad_words")
    if req.allowed_token_ids is not None:
        vocab = config.model.vocab_size
        if any(not 0 <= t < vocab for t in req.allowed_token_ids):
            raise bad_request(f"allowed_token_ids has a token id outside the vocabulary "
                              f"(size {vocab}).", "allowed_token_ids")
    if req.vllm_xargs and not getattr(config, "logits_processors", ()):
        raise bad_request("vllm_xargs are arguments for logits processors, and this server "
                          "loads none (start it with --logits-processors).", "vllm_xargs")
