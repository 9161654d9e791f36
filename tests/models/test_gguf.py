"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) loaded by us vs by transformers.

transformers' reference goes through its own GGUF code (``load_gguf_checkpoint``: its own
dequantization, tensor-name map and Q/K reverse permutation) into its own LlamaForCausalLM.
(``from_pretrained(gguf_file=...)`` does the same but insists on the ``accelerate`` package.)
Measured on fp32: the last-token logits agree to 0.0 (identical weights, same op order); the test
allows 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from paged_harness import PagedHarness

from pagellm.forward_context import set_forward_context
from pagellm.models.loader import build_model, load_hf_config, load_tokenizer, resolve_model_source

pytestmark = pytest.mark.slow  # two loads of a 135M model: about a minute on 2 busy cores


@pytest.fixture(scope="module")
def gguf_models():
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = resolve_model_source(None)
    config = load_hf_config(src)
    tok = load_tokenizer(src)
    ours = build_model(config, src, torch.float32, torch.device("cpu"))
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                           attn_implementation="eager")
    tensors = load_gguf_checkpoint(src.gguf_path, return_tensors=True, model_to_load=ref)
    missing, unexpected = ref.load_state_dict(tensors["tensors"], strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # lm_head is tied
    ref.tie_weights()
    ref.eval()
    ref.generation_config.eos_token_id = None
    return ours, ref, tok


def _prompt(tok) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_gguf_config_and_tokenizer(gguf_models):
    ours, _, tok = gguf_models
    assert ours.config.model_type == "llama" and ours.config.tie_word_embeddings
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert len(tok) == ours.config.vocab_size == 49152
    assert tok.decode(tok("Paris is lovely.").input_ids) == "Paris is lovely."


def test_gguf_last_token_logits_match_transformers(gguf_models):
    ours, ref, tok = gguf_models
    ids = _prompt(tok)
    x = torch.tensor(ids)
    with torch.inference_mode():
        expected = ref(x[None]).logits[0, -1].float()
        with set_forward_context(None, []):
            got = ours.compute_logits(ours(x, torch.arange(len(ids)))[-1:])[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert int(got.argmax()) == int(expected.argmax())


def test_gguf_greedy_tokens_match_transformers(gguf_models):
    ours, ref, tok = gguf_models
    ids = _prompt(tok)
    expected = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    expected = expected[0, len(ids):].tolist()
    got = PagedHarness(ours, num_blocks=16, block_size=16).greedy("a", ids, 8, chunk=11)
    assert got == expected
    assert "Paris" in tok.decode(got)
