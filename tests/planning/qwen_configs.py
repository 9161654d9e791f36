"""Published config.json values of Qwen2.5-7B-Instruct and Qwen2.5-72B-Instruct (Hugging Face,
Qwen/Qwen2.5-{7B,72B}-Instruct), written here so that no test downloads anything."""

from __future__ import annotations

import json
from pathlib import Path

_COMMON = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "use_sliding_window": False, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 152064, "bos_token_id": 151643,
    "eos_token_id": 151645,
}
QWEN25_7B = dict(_COMMON, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_window_layers=28)
QWEN25_72B = dict(_COMMON, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, max_window_layers=80)


def write_config(folder: Path, config: dict) -> str:
    """A model folder holding only config.json (no weights: the planner needs none)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)
