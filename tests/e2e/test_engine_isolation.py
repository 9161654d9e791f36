"""Two engines in one process keep their own state (attention backend, sampling noise, the
backends' scratch buffers and step plans, the default dtype): built with different options
and run interleaved, each gives exactly the tokens it gives alone."""

from __future__ import annotations

import torch

from pagellm import LLM, SamplingParams
from pagellm.layers.attention import Attention

ENGINES = {
    "float32-torch": dict(dtype="float32", attention_backend="torch", seed=0),
    "bfloat16-cpu": dict(dtype="bfloat16", attention_backend="cpu", seed=1),
}
COMMON = dict(max_model_len=256, kv_cache_memory="16MiB", max_num_batched_tokens=64)
# Greedy, unseeded random (the engine's own noise) and seeded random rows in every batch.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)]
# Prompt lengths that chunk under the budget and mix prefill chunks with decodes.
BATCHES = [[{"prompt_token_ids": [(13 * b + 7 * i + j) % 300 + 20 for j in range(5 + 30 * i)]}
            for i in range(len(PARAMS))] for b in range(2)]


def _tokens(llm: LLM, batch: list[dict]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, PARAMS, use_tqdm=False)]


def _backend_names(llm: LLM) -> set[str]:
    runner = llm.llm_engine.engine_core.executor.runner
    return {m.get_backend(runner.device).name for m in runner.model.modules()
            if isinstance(m, Attention)}


def test_two_engines_interleaved_give_what_each_gives_alone(tiny_llama_dir) -> None:
    default_dtype = torch.get_default_dtype()
    alone = {}
    for name, opts in ENGINES.items():
        llm = LLM(model=str(tiny_llama_dir), **COMMON, **opts)
        alone[name] = [_tokens(llm, batch) for batch in BATCHES]
        llm.llm_engine.shutdown()
        del llm

    engines = {name: LLM(model=str(tiny_llama_dir), **COMMON, **opts)
               for name, opts in ENGINES.items()}
    assert torch.get_default_dtype() == default_dtype  # building restored it
    got: dict[str, list] = {name: [] for name in engines}
    for batch in BATCHES:
        for name, llm in engines.items():
            got[name].append(_tokens(llm, batch))
    for name, llm in engines.items():
        # The engine built last did not change the first one's backend.
        assert _backend_names(llm) == {ENGINES[name]["attention_backend"]}
        assert got[name] == alone[name], name
        llm.llm_engine.shutdown()
    assert all(len(t) == 12 for runs in got.values() for batch in runs for t in batch)
