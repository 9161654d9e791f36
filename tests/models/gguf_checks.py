"""Shared by the GGUF family tests (test_gguf_*.py): finishing a GGUF file written in the test,
and the checks that it loads into exactly the model its safetensors source gives and decodes
transformers' greedy tokens."""

from __future__ import annotations

import torch
from hf_compare import NUM_NEW
from paged_harness import PagedHarness


def finish_gguf(writer) -> None:
    """Write a ``gguf.GGUFWriter``'s header, metadata and tensors, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_same_weights(got: torch.nn.Module, want: torch.nn.Module, note: object = None) -> None:
    got_state, want_state = got.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys(), note
    for name, tensor in got_state.items():
        assert torch.equal(tensor, want_state[name]), (name, note)


def assert_same_paged_logits(got: torch.nn.Module, want: torch.nn.Module, ids: list[int]) -> None:
    """Bit for bit: GGUF keeps float32 metadata (eps, rope factors) that the model uses as
    float32, as the safetensors config gives it."""
    logits = PagedHarness(got, block_size=16).step([("a", ids)], all_logits=True)
    expected = PagedHarness(want, block_size=16).step([("a", ids)], all_logits=True)
    assert torch.equal(logits, expected)


def assert_hf_greedy(model: torch.nn.Module, hf, ids: list[int]) -> None:
    """``model`` decodes transformers' greedy tokens (``hf`` from hf_compare.reference)."""
    out = hf.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW, do_sample=False)
    expected_tokens = out[0, len(ids):].tolist()
    assert len(set(expected_tokens)) > 2
    assert PagedHarness(model, block_size=16).greedy("a", ids, NUM_NEW) == expected_tokens
