"""``POST /update_weights_from_disk`` (SGLang's route) on a real server over a tiny model: a
request running when it arrives finishes, later ones get the new model's tokens (those of an
engine built from the new checkpoint), and anything but a checkpoint of the same architecture
under --allowed-weights-path is a 400 naming model_path; the route needs an admin key."""

from __future__ import annotations

import shutil
import threading

import httpx
import pytest
from server_utils import ADMIN_KEY, ADMIN_TENANT_KEY
from weight_update_utils import perturbed_model

from pagellm import LLM, SamplingParams

API_KEY = ADMIN_TENANT_KEY
PROMPT = [5, 17, 42, 99, 7, 64, 23, 11]


def post(server, path, body, key=API_KEY, timeout=300):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=timeout)


def complete(server, max_tokens=8) -> dict:
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens,
                                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.fixture(scope="module")
def root(admin_weights_root):
    return admin_weights_root  # the server's --allowed-weights-path


@pytest.fixture(scope="module")
def server(admin_server):
    return admin_server  # ADMIN_ARGS (prefix caching, 256 positions, 16MiB) on tiny_llama_dir


def test_update_weights_from_disk(server, tiny_llama_dir, root) -> None:
    new_path = root / "new"
    new_path.mkdir()
    perturbed_model(tiny_llama_dir, new_path)
    before = complete(server)["text"]
    # A long request in flight while the update arrives: it must finish, not fail.
    long_result: dict = {}
    thread = threading.Thread(target=lambda: long_result.update(complete(server, 200)))
    thread.start()
    r = post(server, "/update_weights_from_disk", {"model_path": "new"}, key=ADMIN_KEY)
    thread.join(300)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    assert long_result["finish_reason"] == "length"
    after = complete(server)["text"]
    fresh = LLM(model=str(new_path), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    want = fresh.generate({"prompt_token_ids": PROMPT},
                          SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    assert after == want
    assert after != before


@pytest.mark.parametrize("which", ["missing", "other_arch", "outside", "no_body"])
def test_bad_model_path_is_400(server, root, tiny_model_dir, tiny_llama_dir, which) -> None:
    if which == "other_arch" and not (root / "qwen2").exists():
        shutil.copytree(tiny_model_dir("qwen2"), root / "qwen2")
    body = {"missing": {"model_path": str(root / "nope")},
            "other_arch": {"model_path": "qwen2"},
            "outside": {"model_path": str(tiny_llama_dir)},  # a good checkpoint, not under root
            "no_body": {}}[which]
    r = post(server, "/update_weights_from_disk", body, key=ADMIN_KEY)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model_path"
    assert complete(server)  # still serving


def test_needs_an_admin_key(server, root) -> None:
    r = post(server, "/update_weights_from_disk", {"model_path": "new"}, key=None)
    assert r.status_code == 401
    r = post(server, "/update_weights_from_disk", {"model_path": "new"})  # a tenant's key
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
