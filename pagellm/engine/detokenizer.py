"""Incremental detokenization with stop strings, for streaming outputs.

Text is produced token by token with ``tokenizers``' DecodeStream on the fast tokenizer's backend
(it buffers incomplete UTF-8 and keeps byte-level BPE merges right), primed with the tail of the
prompt so the first output token gets its leading space. Tokenizers without a backend use the
prefix/read-offset scheme instead. Either way, the concatenated pieces equal a one-shot decode.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers is a hard dependency; keep the fallback usable
    Tokenizer = DecodeStream = None  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
# tokenizers raises this when a decoder's output is not monotonic in the ids (rare, seen with
# some byte-fallback vocabularies); the stream is then restarted.
_INVALID_PREFIX_ERR = "Invalid prefix encountered"
_PRIME_MIN, _PRIME_MAX = 4, 24  # prompt-tail lengths tried for priming
_OFFSET_PREFIX = 5  # tokens of context the offset scheme keeps before the read offset


def _backend(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind a transformers fast tokenizer, or None."""
    if Tokenizer is None:
        return None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    for attr in ("_tokenizer", "backend_tokenizer"):
        backend = getattr(tokenizer, attr, None)
        if isinstance(backend, Tokenizer):
            return backend
    return None


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One token's text on its own, for logprob display (special tokens shown, partial UTF-8 as
    U+FFFD)."""
    backend = _backend(tokenizer)
    if backend is not None:
        return backend.decode([token_id], skip_special_tokens=False)
    return tokenizer.decode([token_id], skip_special_tokens=False)


class _StreamDecoder:
    """DecodeStream over the backend tokenizer; ``step`` returns new text or None (buffering)."""

    def __init__(self, backend: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in self._priming_tail(prompt_token_ids):
            self.step(token_id)

    def _priming_tail(self, prompt_token_ids: list[int]) -> list[int]:
        # A few prompt tokens give the decoder its context (leading spaces); start where the tail
        # decodes cleanly, not inside a multi-byte character.
        if len(prompt_token_ids) <= _PRIME_MIN:
            return prompt_token_ids
        for n in range(_PRIME_MIN, min(len(prompt_token_ids), _PRIME_MAX) + 1):
            tail = prompt_token_ids[-n:]
            text = self.backend.decode(tail, skip_special_tokens=self.skip_special_tokens)
            if not text.startswith(_REPLACEMENT):
                return tail
        return prompt_token_ids[-_PRIME_MIN:]

    def step(self, token_id: int) -> str | None:
        try:
            return self.stream.step(self.backend, token_id)
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX_ERR):
                raise
            logger.warning("DecodeStream reported an invalid prefix; restarting the stream.")
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self.stream.step(self.backend, token_id)


class _OffsetDecoder:
    """Prefix/read-offset scheme over ``tokenizer.decode``: decode the window with and without
    the unread tokens and emit the difference once it does not end in partial UTF-8. The window
    starts at the tokens of the previous emission (the context the decoder needs)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_OFFSET_PREFIX:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return None
        # The tokens read so far become the next window's context; older ones are dropped.
        del self.ids[:self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        return full[len(prefix):]


class IncrementalDetokenizer:
    """One sample's output text, built token by token, cut at the first stop string.

    ``update`` decodes new tokens and returns the stop string that matched (the text is then
    truncated before it, or after it with ``include_stop_str_in_output``, and later tokens are
    ignored), else None. Stop strings are searched only once the output has more than
    ``min_tokens`` tokens. With ``stop_terminated`` the last token (EOS or a stop token id) is
    recorded but its text left out, unless ``include_stop_str_in_output``.

    While streaming, ``get_next_output_text`` holds back the last ``max(len(stop)) - 1``
    characters so a stop string is never sent in part (nothing is held back when the stop string
    is kept in the output: every sent character is then final).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.stop_buffer_length = (max(len(s) for s in self.stop) - 1
                                   if self.stop and not include_stop_str_in_output else 0)
        backend = _backend(tokenizer)
        self._decoder: _StreamDecoder | _OffsetDecoder
        if backend is not None and DecodeStream is not None:
            self._decoder = _StreamDecoder(backend, prompt_token_ids, skip_special_tokens)
        else:
            self._decoder = _OffsetDecoder(tokenizer, prompt_token_ids, skip_special_tokens)
        self.output_token_ids: list[int] = []
        self.stop_reason: str | None = None
        self._text = ""
        self._checked_len = 0  # a stop string ending within text[:_checked_len] is ruled out
        self._sent_len = 0  # characters already returned by get_next_output_text(delta=True)

    @property
    def output_text(self) -> str:
        return self._text

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        if self.stop_reason is not None or not new_token_ids:
            return None
        skip_last = stop_terminated and not self.include_stop_str_in_output
        last = len(new_token_ids) - 1
        for i, token_id in enumerate(new_token_ids):
            self.output_token_ids.append(token_id)
            if skip_last and i == last:
                break
            piece = self._decoder.step(token_id)
            if not piece:
                continue
            self._text += piece
            if not self.stop or len(self.output_token_ids) <= self.min_tokens:
                self._checked_len = len(self._text)
                continue
            if self._check_stop():
                return self.stop_reason
        return None

    def _check_stop(self) -> bool:
        text = self._text
        best: tuple[int, str] | None = None
        for stop_str in self.stop:
            # Only matches that end in the new characters; earlier ones were ruled out.
            idx = text.find(stop_str, max(self._checked_len - len(stop_str) + 1, 0))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop_str)
        self._checked_len = len(text)
        if best is None:
            return False
        idx, stop_str = best
        cut = idx + len(stop_str) if self.include_stop_str_in_output else idx
        assert cut >= self._sent_len, "a streamed character was cut by a stop string"
        self._text = text[:cut]
        self.stop_reason = stop_str
        return True

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The whole text so far (``delta`` False) or what is new since the last delta call.

        Unless ``finished`` (or a stop string already ended the text), the last
        ``stop_buffer_length`` characters are held back."""
        hold = 0 if finished or self.stop_reason is not None else self.stop_buffer_length
        end = max(len(self._text) - hold, 0)
        if not delta:
            return self._text[:end]
        start = self._sent_len
        if end <= start:
            return ""
        self._sent_len = end
        return self._text[start:end]


class TokenIdsOnly:
    """``IncrementalDetokenizer``'s interface for ``SamplingParams(detokenize=False)``: keeps
    the token ids, decodes nothing (RL rollouts that need only ids); text stays empty."""

    stop_reason: str | None = None

    def __init__(self) -> None:
        self.output_token_ids: list[int] = []

    @property
    def output_text(self) -> str:
        return ""

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        self.output_token_ids += new_token_ids
        return None  # stop strings are refused with detokenize=False

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        return ""
