"""``LLM.load_weights`` on hybrid models whose checkpoint names differ from pagellm's parameter
names (Qwen3.5's image-text prefix is covered by the loader test; here Granite 4's stacked
experts and shared MLP, Nemotron-H's ``backbone.`` prefix, Qwen3.5's dense layers): the update
takes the names a trainer sends and the engine then generates what a fresh one built from the
same weights does."""

from __future__ import annotations

import pytest
from weight_update_utils import checkpoint_weights, perturbed_model, prompts, tokens

from pagellm import LLM


@pytest.mark.parametrize("arch", ["granite4", "nemotron-h", "qwen3.5"])
@pytest.mark.parametrize("source", ["checkpoint", "trainer"])
def test_update_equals_fresh_engine(tiny_model_dir, tmp_path, arch, source) -> None:
    """``checkpoint``: the saved checkpoint's names; ``trainer``: transformers'
    ``named_parameters()`` (stacked experts where transformers 5 keeps them so)."""
    src = tiny_model_dir(arch)
    trained = perturbed_model(src, tmp_path)
    weights = checkpoint_weights(tmp_path) if source == "checkpoint" else trained
    kw = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256}
    llm = LLM(model=str(src), **kw)
    ps = prompts(llm.llm_engine.config.model.vocab_size)
    before = tokens(llm, ps)
    assert llm.load_weights(weights.items()) == len(weights)
    after = tokens(llm, ps)
    assert after == tokens(LLM(model=str(tmp_path), **kw), ps)
    assert after != before
