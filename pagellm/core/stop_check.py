"""When a request's newest token ends it: the scheduler's stop rules (pure Python)."""

from __future__ import annotations

import logging

from pagellm.request import Request, RequestStatus

logger = logging.getLogger("pagellm")


def accept_grammar_token(request: Request, token_id: int) -> bool:
    """Feed a sampled token to the request's grammar; False (and FINISHED_ERROR) when the
    grammar refuses it, which only a row with no allowed token at all can sample."""
    if request.grammar.accept_token(token_id):
        return True
    logger.error("Request %s sampled token %d, which its grammar does not allow; finishing "
                 "it with an error.", request.request_id, token_id)
    request.status = RequestStatus.FINISHED_ERROR
    return False


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set a finished status if the last token ends the request (EOS, a stop token, a finished
    grammar, max_tokens or the context's end)."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.grammar is not None and request.grammar.is_terminated():
        # The grammar's output is complete (it accepted a stop token). It may end short of
        # min_tokens: the bitmask allowed the end early only when nothing else was possible.
        request.status = RequestStatus.FINISHED_STOPPED
        if last in (params.stop_token_ids or ()):
            request.stop_reason = last
        return True
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in (params.stop_token_ids or ()):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if (request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= max_model_len):
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False
