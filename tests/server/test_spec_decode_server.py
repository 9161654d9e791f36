"""`pagellm serve --speculative-config`: the OpenAI client gets the same text streamed or not,
and /metrics exposes vLLM's acceptance counters, non-zero after a copy-heavy request."""

from __future__ import annotations

import json

import openai
import pytest
from server_utils import TINY_ARGS, ServerProcess, metric, scrape

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4, "disable_by_batch_size": None}
TEXT = ("The block table maps each sequence to its blocks, so memory is allocated on demand "
        "and shared prefixes are stored only once.")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("spec") / "server.log"
    srv = ServerProcess([*TINY_ARGS, "--speculative-config", json.dumps(SPEC)], log)
    yield srv
    srv.stop()


def test_copy_request_streams_and_counts_acceptance(server) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]
    full = client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=messages, temperature=0, max_tokens=40)
    text = full.choices[0].message.content
    assert text and full.usage.completion_tokens > 0
    chunks = client.chat.completions.create(model=full.model, messages=messages, temperature=0,
                                            max_tokens=40, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    m = scrape(server.base_url)
    drafts = metric(m, "pagellm:spec_decode_num_drafts_total")
    draft_tokens = metric(m, "pagellm:spec_decode_num_draft_tokens_total")
    accepted = metric(m, "pagellm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= draft_tokens <= 4 * drafts
    per_pos = [metric(m, "pagellm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
               for p in range(4)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
