"""vLLM's render endpoints: ``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``
take the body of /v1/completions or /v1/chat/completions, run the endpoint's own checks and
prompt rendering (the same code: ``render`` of OpenAIServingCompletion / OpenAIServingChat), start
nothing, and answer with vLLM's GenerateRequest shape: the token ids the request would run on and
its sampling parameters. vllm-router's cache_aware policy reads ``token_ids`` to route by prefix.
Errors are the real endpoint's (same status, message and param)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    random_id,
)
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.sampling_params import SamplingParams

COMPLETIONS_RENDER_PATH = "/v1/completions/render"
CHAT_RENDER_PATH = "/v1/chat/completions/render"


def sampling_params_json(params: SamplingParams, num_prompt_tokens: int,
                         max_model_len: int) -> dict[str, Any]:
    """The parameters as the engine runs them (vLLM's field names): ``max_tokens`` is the
    number the engine allows, as it cuts it (null: the rest of the context)."""
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
           if not f.name.startswith("_")}
    out["stop"] = list(params.stop_strs)  # vLLM's form: always a list
    room = max_model_len - num_prompt_tokens
    out["max_tokens"] = room if params.max_tokens is None else min(params.max_tokens, room)
    if params.structured_outputs is not None:
        out["structured_outputs"] = dataclasses.asdict(params.structured_outputs)
    return out


def generate_request(request_id: str, token_ids: list[int], params: SamplingParams,
                     req: SamplingFields, max_model_len: int) -> dict[str, Any]:
    """vLLM's GenerateRequest (what its /inference/v1/generate takes); ``features`` (multimodal)
    and ``kv_transfer_params`` (disaggregated prefill) are always null here. ``cache_salt`` is
    the client's own: the tenant namespace the server adds is never shown."""
    return {"request_id": request_id, "token_ids": list(token_ids), "features": None,
            "sampling_params": sampling_params_json(params, len(token_ids), max_model_len),
            "model": req.model, "stream": req.stream,
            "stream_options": (req.stream_options.model_dump()
                               if req.stream and req.stream_options else None),
            "cache_salt": req.cache_salt, "priority": req.priority,
            "kv_transfer_params": None}


def add_render_routes(app: FastAPI, completions: OpenAIServingCompletion,
                      chat: OpenAIServingChat) -> None:
    """Behind the API key as every /v1 route (the key middleware wraps the app)."""
    max_model_len = completions.models.max_model_len

    @app.post(COMPLETIONS_RENDER_PATH)
    async def render_completion(body: CompletionRequest) -> JSONResponse:
        request_id = random_id(completions.request_id_prefix)
        rendered = await completions.guarded(completions.render(body), request_id)
        many = len(rendered.prompts) > 1
        return JSONResponse([generate_request(f"{request_id}-{i}" if many else request_id,
                                              prompt["prompt_token_ids"], rendered.params,
                                              body, max_model_len)
                             for i, prompt in enumerate(rendered.prompts)])

    @app.post(CHAT_RENDER_PATH)
    async def render_chat_completion(body: ChatCompletionRequest) -> JSONResponse:
        request_id = random_id(chat.request_id_prefix)
        rendered = await chat.guarded(chat.render(body), request_id)
        return JSONResponse(generate_request(request_id, rendered.prompt["prompt_token_ids"],
                                             rendered.params, body, max_model_len))
