"""Prompt scoring over HTTP against a real ``pagellm serve`` (tiny random Llama, 16-token steps so
prompts are prefilled in chunks, prefix caching on), checked against transformers on the same
weights: ``echo`` + ``logprobs`` on /v1/completions (with ``max_tokens: 0`` too, text and
token-id prompts), vLLM's ``prompt_logprobs`` field, and lm-evaluation-harness's
``local-completions`` model running a local multiple-choice and a generation task."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_utils import ServerProcess

TOL = 1e-4  # per token: float32 server vs float32 transformers
TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
ARGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256",
        "--max-num-batched-tokens", "16", "--enable-prefix-caching", "--served-model-name",
        "tiny"]
TEXT = "Paged attention stores keys and values in fixed-size blocks. Hello, world!"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    srv = ServerProcess([str(model_dir), *ARGS],
                        tmp_path_factory.mktemp("prompt-logprobs") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    """ids -> [len(ids), vocab] float64 logprobs: row i predicts token i + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)

    return logprobs


def completion(http, **body) -> dict:
    resp = http.post("/v1/completions", json={"model": "tiny", "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def assert_echoed_scores(logprobs: dict, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """The echoed prompt part of a legacy ``logprobs`` object: null first, then each token's
    logprob and a top_logprobs of the token plus the top-k."""
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert abs(logprobs["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < TOL
        top = logprobs["top_logprobs"][i]
        assert 1 <= len(top) <= k + 1
        # Its best entry is the reference's best (token strings may collide: not counted).
        assert abs(max(top.values()) - ref[i - 1].max().item()) < TOL


@pytest.mark.parametrize("form", ["text", "ids", "batch"])
def test_echo_with_max_tokens_0_scores_the_prompt(http, tokenizer, reference, form) -> None:
    ids = tokenizer.encode(TEXT)
    others = [ids[:5], ids[7:40]]
    prompt = {"text": TEXT, "ids": ids, "batch": [ids, *others]}[form]
    body = completion(http, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    prompts = [ids, *others] if form == "batch" else [ids]
    assert len(body["choices"]) == len(prompts)
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    for choice, p in zip(sorted(body["choices"], key=lambda c: c["index"]), prompts,
                         strict=True):
        lp = choice["logprobs"]
        assert choice["text"] == tokenizer.decode(p) and choice["finish_reason"] == "length"
        assert len(lp["tokens"]) == len(p) and "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i])
                                     for i in range(len(p))]
        assert_echoed_scores(lp, p, reference(p), 2)


def test_echo_with_generation_is_prompt_then_completion(http, tokenizer, reference) -> None:
    ids = tokenizer.encode(TEXT)
    plain = completion(http, prompt=ids, logprobs=1, max_tokens=3, ignore_eos=True)
    echoed = completion(http, prompt=ids, logprobs=1, max_tokens=3, ignore_eos=True,
                        echo=True)
    (p,), (e,) = plain["choices"], echoed["choices"]
    assert e["text"] == tokenizer.decode(ids) + p["text"]
    n = len(ids)
    lp = e["logprobs"]
    assert len(lp["token_logprobs"]) == n + 3
    assert_echoed_scores(lp, ids, reference(ids), 1)
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert lp[key][n:] == p["logprobs"][key]
    assert echoed["usage"]["completion_tokens"] == 3


def test_streamed_echo_carries_the_prompt_scores(http, tokenizer, reference) -> None:
    ids = tokenizer.encode(TEXT)
    with http.stream("POST", "/v1/completions", json={
            "model": "tiny", "prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 2,
            "temperature": 0, "ignore_eos": True, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"].startswith(TEXT)
    assert_echoed_scores(first["logprobs"], ids, reference(ids), 1)
    assert sum(len(ev["choices"][0]["logprobs"]["tokens"]) for ev in events) == len(ids) + 2


def test_prompt_logprobs_field_in_vllm_shape(http, server, tokenizer, reference) -> None:
    ids = tokenizer.encode(TEXT)
    body = completion(http, prompt=TEXT, prompt_logprobs=3, max_tokens=2)
    scores = body["choices"][0]["prompt_logprobs"]
    ref = reference(ids)
    assert len(scores) == len(ids) and scores[0] is None
    for i in range(1, len(ids)):
        entry = scores[i]
        own = entry[str(ids[i])]
        assert abs(own["logprob"] - ref[i - 1, ids[i]].item()) < TOL
        assert own["decoded_token"] == tokenizer.decode([ids[i]])
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(ids[i]) or
                       e["rank"] <= 3)
        assert ranks == [1, 2, 3]
        for t, e in entry.items():
            assert abs(e["logprob"] - ref[i - 1, int(t)].item()) < TOL
    # Not asked: null, as vLLM.
    assert completion(http, prompt=TEXT, max_tokens=1)["choices"][0]["prompt_logprobs"] is None
    # Chat, through the official client: the rendered prompt's scores at the top level.
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello, world!"}], max_tokens=1,
        temperature=0, extra_body={"prompt_logprobs": 0})
    chat_scores = chat.model_extra["prompt_logprobs"]
    assert len(chat_scores) == chat.usage.prompt_tokens and chat_scores[0] is None
    assert all(len(entry) >= 1 for entry in chat_scores[1:])


@pytest.mark.parametrize(("path", "fields"), [
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "prompt_logprobs": 1, "stream": True}),
])
def test_bad_prompt_logprobs_are_400_naming_the_field(http, path, fields) -> None:
    resp = http.post(path, json={"model": "tiny", "max_tokens": 1, **fields})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "prompt_logprobs"


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into token ids (no special tokens)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def test_lm_eval_local_completions(server, http, model_dir, tokenizer, reference, tmp_path,
                                   monkeypatch) -> None:
    """lm-eval itself (in this process: its CLI, in docs/serving.md, runs the same
    simple_evaluate) scores every choice of a local multiple-choice task through echo +
    logprobs, and runs a generation task; no network (local jsonl documents)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import datasets.config
    import lm_eval
    from lm_eval.tasks import TaskManager

    # In case datasets was imported before the environment was set.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.chdir(TASKS_DIR)  # the task YAMLs name their jsonl files relative to it
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(f"model=tiny,base_url={server.base_url}/v1/completions,"
                    f"tokenizer={model_dir},tokenizer_backend=huggingface,max_length=256"),
        tasks=["pagellm_tiny_mc", "pagellm_tiny_gen"], batch_size=16, log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False))
    assert results is not None

    mc = results["samples"]["pagellm_tiny_mc"]
    assert len(mc) == 5
    accs = []
    for doc in mc:
        lls = []
        # In process, each request's arguments are (context, continuation).
        for (context, continuation), resp in zip(doc["arguments"], doc["resps"], strict=True):
            ctx, cont = _encode_pair(tokenizer, context, continuation)
            ref = reference(ctx + cont)
            expected = sum(ref[len(ctx) + j - 1, t].item() for j, t in enumerate(cont))
            got = float(resp[0][0])
            assert abs(got - expected) < TOL * len(cont), (continuation, got, expected)
            lls.append(expected)
        accs.append(float(lls.index(max(lls)) == int(doc["target"])))
        assert doc["acc"] == accs[-1]
    assert results["results"]["pagellm_tiny_mc"]["acc,none"] == pytest.approx(sum(accs) / 5)

    gen = results["samples"]["pagellm_tiny_gen"]
    assert len(gen) == 3
    for doc in gen:
        ((context, _gen_kwargs),) = doc["arguments"]
        ids = tokenizer(context, add_special_tokens=False).input_ids
        # lm-eval's answer is the server's own greedy text for the same request.
        direct = completion(http, prompt=ids, max_tokens=8, stop=["\n"], seed=1234)
        assert doc["resps"][0][0] == direct["choices"][0]["text"]
