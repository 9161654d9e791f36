"""One request's grammar in the engine core: its compile, then a matcher of its output."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class RequestGrammar:
    """The compile future of a request's spec, then an xgrammar matcher that has accepted every
    output token the request has (the scheduler feeds it each token it appends).

    The matcher's state is a function of the output tokens only. Preemption by recompute keeps
    a request's output tokens (only its KV is recomputed), so the matcher stays as it is and the
    next token it masks continues the same output.
    """

    def __init__(self, compiled: Future, output_token_ids: list[int]) -> None:
        self.future = compiled
        self._output_token_ids = output_token_ids  # the Request's own list (read only)
        self._matcher: Any = None
        self.num_accepted = 0
        # Set by the engine core between steps once the compile succeeded; the scheduler admits
        # the request only then.
        self.ready = False

    def is_compiled(self) -> bool:
        """The compile finished (successfully or not)."""
        return self.future.done()

    def compile_error(self) -> BaseException | None:
        if not self.future.done():
            return None
        return self.future.exception()

    def ensure_matcher(self) -> Any:
        """The matcher, made on first use (it replays the output tokens the request already
        has, so a matcher made late is in the same state as one made early)."""
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self.future.result())
            for token_id in self._output_token_ids:
                if not self._matcher.accept_token(token_id):
                    break
                self.num_accepted += 1
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance over a sampled token, before the request appends it; False when the grammar
        does not allow it (the request must then end: its output would not match)."""
        ok = bool(self.ensure_matcher().accept_token(token_id))
        if ok:
            self.num_accepted += 1
        return ok

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self._matcher is not None and bool(self._matcher.is_terminated())

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (a CPU int32 torch tensor)."""
        self.ensure_matcher().fill_next_token_bitmask(bitmask, row)
