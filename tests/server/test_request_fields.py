"""vLLM's request fields end to end on a real server (tiny random llama) through the openai SDK:
bad_words, allowed_token_ids, truncate_prompt_tokens, chat_template_kwargs, documents, chat
echo, and a --logits-processors plugin (examples/) reading vllm_xargs; then the LLM API."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import REPO, ServerProcess

TEMPLATE = (
    "{% for d in documents or [] %}DOC {{ d['title'] }}: {{ d['text'] }}\n{% endfor %}"
    "{% if enable_thinking is defined %}THINKING {{ enable_thinking }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not (loop.last and m['role'] == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROCESSOR = "logits_processor_force_token:ForceTokenProcessor"
PROMPT = "The quick brown fox jumps over the lazy dog and"


@pytest.fixture(scope="module")
def server(tmp_path_factory, make_tiny_model):
    root = tmp_path_factory.mktemp("fields")
    model = make_tiny_model(root / "model", "llama")
    template = root / "template.jinja"
    template.write_text(TEMPLATE)
    srv = ServerProcess([str(model), "--dtype", "float32", "--kv-cache-memory", "64MiB",
                         "--max-model-len", "256", "--chat-template", str(template),
                         "--logits-processors", PROCESSOR, "--max-bad-words", "4",
                         "--served-model-name", "m"],
                        root / "server.log",
                        env={"PYTHONPATH": f"{REPO}:{REPO / 'examples'}"})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def _complete(client, prompt=PROMPT, max_tokens=12, **extra):
    return client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body={"return_token_ids": True,
                                                                "ignore_eos": True, **extra})


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _tokenize(server, text: str) -> list[int]:
    r = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text,
                                                        "add_special_tokens": False})
    return r.json()["tokens"]


def _detokenize(server, ids: list[int]) -> str:
    return httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}).json()["prompt"]


def test_bad_words_never_appear(server, client):
    plain = _complete(client).choices[0]
    ids = plain.token_ids
    # A word the greedy output writes: the first non-blank token text whose tokens (bare or
    # after a space) the output holds (a byte-level piece of a character does not qualify).
    words = [w for w in (_detokenize(server, [t]).strip() for t in ids) if w]
    word = next((w for w in words if any(_contains(ids, s) for s in (
        _tokenize(server, w), _tokenize(server, " " + w)))), None)
    assert word is not None, ("the greedy answer writes no word as its own tokens", words)
    seqs = [_tokenize(server, word), _tokenize(server, " " + word)]
    banned = _complete(client, bad_words=[word]).choices[0]
    assert banned.token_ids != ids
    assert not any(_contains(banned.token_ids, s) for s in seqs[:1])
    spaced = seqs[1]
    if spaced[0] != seqs[0][0] and len(spaced) == len(seqs[0]):
        assert not _contains(banned.token_ids, spaced)
    with pytest.raises(openai.BadRequestError, match="--max-bad-words"):
        _complete(client, bad_words=["a", "b", "c", "d", "e"])


def test_allowed_token_ids(client):
    plain = _complete(client).choices[0].token_ids
    allowed = [t for t in range(40, 60) if t not in plain][:5]
    out = _complete(client, allowed_token_ids=allowed).choices[0].token_ids
    assert len(out) == 12 and set(out) <= set(allowed)
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        _complete(client, allowed_token_ids=[10**6])


def test_truncate_prompt_tokens(server, client):
    ids = _tokenize(server, PROMPT * 3)
    cut = _complete(client, prompt=ids, truncate_prompt_tokens=7)
    manual = _complete(client, prompt=ids[-7:])
    assert cut.usage.prompt_tokens == 7 == manual.usage.prompt_tokens
    assert cut.choices[0].token_ids == manual.choices[0].token_ids
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPT * 3}], max_tokens=2,
        extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        _complete(client, prompt=ids, truncate_prompt_tokens=10_000)


def _rendered_text(server, **body) -> str:
    r = httpx.post(f"{server.base_url}/v1/chat/completions/render",
                   json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 200, r.text
    return _detokenize(server, r.json()["token_ids"])


def test_chat_template_kwargs_and_documents_reach_the_template(server):
    assert "THINKING" not in _rendered_text(server)
    assert "THINKING False" in _rendered_text(
        server, chat_template_kwargs={"enable_thinking": False})
    docs = [{"title": "Paris", "text": "capital of France"}, {"title": "Rome", "text": "Italy"}]
    text = _rendered_text(server, documents=docs)
    assert "DOC Paris: capital of France\nDOC Rome: Italy" in text
    for body, param in [({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": {"x": "y" * 20000}}, "chat_template_kwargs"),
                        ({"chat_template": "{{ 1 }}"}, "chat_template")]:
        r = httpx.post(f"{server.base_url}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_echo(client):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}]
    common = dict(model="m", messages=messages, max_tokens=4, temperature=0)
    body = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(**common, extra_body=body)
    echoed = client.chat.completions.create(**common, extra_body={**body, "echo": True})
    assert echoed.choices[0].message.content == "Well," + plain.choices[0].message.content
    chunks = list(client.chat.completions.create(**common, stream=True,
                                                 extra_body={**body, "echo": True}))
    contents = [c.choices[0].delta.content for c in chunks if c.choices]
    assert contents[1] == "Well,"
    assert "".join(x or "" for x in contents) == echoed.choices[0].message.content
    # With a generation prompt the answer is a new assistant message: nothing to echo.
    user_last = client.chat.completions.create(
        model="m", messages=messages[:1], max_tokens=4, temperature=0, extra_body={"echo": True})
    alone = client.chat.completions.create(model="m", messages=messages[:1], max_tokens=4,
                                           temperature=0)
    assert user_last.choices[0].message.content == alone.choices[0].message.content


def test_logits_processor_plugin_reads_vllm_xargs(client):
    plain = _complete(client).choices[0].token_ids
    forced_id = next(t for t in range(50, 100) if t not in plain)
    forced = _complete(client, vllm_xargs={"force_token_id": forced_id}).choices[0].token_ids
    assert forced == [forced_id] * 12
    assert _complete(client).choices[0].token_ids == plain  # others untouched
    with pytest.raises(openai.BadRequestError, match="logits_processors"):
        _complete(client, logits_processors=["os:system"])


def test_llm_api_fields(tiny_llama_dir, tiny_tokenizer):
    from pagellm import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="64MiB", max_model_len=128)
    ids = tiny_tokenizer.encode(PROMPT * 2)
    greedy = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
    base = llm.generate({"prompt_token_ids": ids}, SamplingParams(**greedy))[0]
    first = base.outputs[0].token_ids
    cut = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(**greedy, truncate_prompt_tokens=6))[0]
    manual = llm.generate({"prompt_token_ids": ids[-6:]}, SamplingParams(**greedy))[0]
    assert cut.prompt_token_ids == ids[-6:]
    assert cut.outputs[0].token_ids == manual.outputs[0].token_ids
    allowed = [t for t in range(30, 40) if t not in first][:3]
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(**greedy, allowed_token_ids=allowed))[0]
    assert set(out.outputs[0].token_ids) <= set(allowed)
    word = next(w for w in (tiny_tokenizer.decode([t]).strip() for t in first) if w)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(**greedy, bad_words=[word]))[0]
    assert not _contains(list(out.outputs[0].token_ids),
                         tiny_tokenizer.encode(word, add_special_tokens=False))
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(msgs, chat_template_kwargs={"add_generation_prompt": False})
    template = "{{ flavour }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    a = llm.chat(msgs, SamplingParams(max_tokens=1), chat_template=template,
                 chat_template_kwargs={"flavour": "salty"})[0]
    assert tiny_tokenizer.decode(a.prompt_token_ids).endswith("saltyhi")
