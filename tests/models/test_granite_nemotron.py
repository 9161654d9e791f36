"""Granite 4 hybrids and Nemotron-H (Mamba-2 + attention) against transformers on the same tiny
random checkpoints: prompt logits within 1e-4 and greedy tokens identical, whole and chunked
prefill (the conv window and SSM state carried in their slot across chunks); the config
variants each model implements; the refusals."""

from __future__ import annotations

import pytest
from hf_compare import (
    PROMPT,
    check_against_hf,
    check_chunks_beside_a_decode,
    ours,
    reference,
)
from paged_harness import PagedHarness
from tiny_tokenizer import build_test_tokenizer

ARCHS = ["granite4", "nemotron-h"]


def _ids(n: int) -> list[int]:
    ids = build_test_tokenizer()(PROMPT * 4)["input_ids"]
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    check_against_hf(ours(path), reference(path), _ids(150))


@pytest.mark.parametrize(("arch", "overrides"), [
    ("granite4", {"position_embedding_type": "nope", "num_local_experts": 0}),
    ("nemotron-h", {"moe_latent_size": 24, "n_group": 1, "topk_group": 1,
                    "norm_topk_prob": False}),
], ids=["granite-nope-dense", "nemotron-latent-moe"])
def test_variants_match_transformers(tmp_path, make_tiny_model, arch, overrides):
    path = make_tiny_model(tmp_path / arch, arch, seed=1, **overrides)
    check_against_hf(ours(path), reference(path), _ids(100))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_next_to_a_decoding_sequence(tiny_model_dir, arch):
    """A 200-token prompt in chunks of 70 (past the 32-token SSD chunk, unaligned), next to
    another sequence decoding in the same batches: tokens identical to transformers'."""
    path = tiny_model_dir(arch)
    check_chunks_beside_a_decode(ours(path), reference(path), _ids(200), _ids(40)[::-1])


def test_layers_and_state_shapes(make_tiny_config):
    from pagellm.core.kv_cache_groups import kv_cache_layout
    from pagellm.models.granite_hybrid import GraniteMoeHybridForCausalLM
    from pagellm.models.nemotron_h import NemotronHForCausalLM
    from pagellm.models.registry import get_model_cls

    granite, nemotron = make_tiny_config("granite4"), make_tiny_config("nemotron-h")
    assert get_model_cls(granite) is GraniteMoeHybridForCausalLM
    assert get_model_cls(nemotron) is NemotronHForCausalLM
    # conv over x|B|C: 128 + 2*2*16 channels, window 3; state [4 heads, 32, 16] float32.
    shapes = (((192, 3), False), ((4, 32, 16), True))
    assert GraniteMoeHybridForCausalLM.recurrent_layers(granite) == (0, 2)
    assert GraniteMoeHybridForCausalLM.recurrent_state_shapes(granite, 1) == shapes
    # Nemotron-H numbers only its cache layers (M, *, M of M E * M -).
    assert NemotronHForCausalLM.layer_sliding_windows(nemotron) == [None] * 3
    assert NemotronHForCausalLM.recurrent_layers(nemotron) == (0, 2)
    assert NemotronHForCausalLM.recurrent_state_shapes(nemotron, 1) == shapes
    # ... so the engine allocates KV for its one attention layer, none for MLP/MoE blocks.
    layout = kv_cache_layout(NemotronHForCausalLM.layer_sliding_windows(nemotron),
                             NemotronHForCausalLM.recurrent_layers(nemotron))
    assert layout.num_tensors == 1 and layout.tensor_of_layer == (-1, 0, -1)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_own_names_load(tiny_model_dir, arch):
    """transformers' in-memory names (stacked experts, ``model.`` prefix, Granite's
    ``router.weight``) load into the same model as the checkpoint's names."""
    import torch

    path = tiny_model_dir(arch)
    model, ref = ours(path), reference(path)
    names = set(ref.state_dict())
    assert any(n.endswith(("experts.gate_up_proj", "experts.up_proj")) for n in names)
    ids = _ids(40)
    before = PagedHarness(model, block_size=16).step([("a", ids)], all_logits=True)
    for p in model.parameters():
        p.data.zero_()
    model.load_weights(ref.state_dict().items())
    after = PagedHarness(model, block_size=16).step([("a", ids)], all_logits=True)
    torch.testing.assert_close(after, before, atol=0, rtol=0)


@pytest.mark.parametrize(("arch", "overrides", "match"), [
    ("granite4", {"position_embedding_type": "alibi"}, "position_embedding_type 'alibi'"),
    ("granite4", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("nemotron-h", {"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu'"),
    ("nemotron-h", {"n_routed_experts": 5, "n_group": 2}, "n_group"),
])
def test_unsupported_configs_are_refused(make_tiny_config, arch, overrides, match):
    from pagellm.models.registry import get_model_cls

    config = make_tiny_config(arch, **overrides)
    with pytest.raises(ValueError, match=match):
        get_model_cls(config)(config)


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_parallel_is_refused(monkeypatch, make_tiny_config, arch):
    from pagellm.models import mamba_hybrid
    from pagellm.models.registry import get_model_cls

    monkeypatch.setattr(mamba_hybrid, "get_tp_size", lambda: 2)
    config = make_tiny_config(arch)
    with pytest.raises(ValueError, match="--tensor-parallel-size 1"):
        get_model_cls(config)(config)
