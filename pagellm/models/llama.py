"""Llama (and Mistral, same tensors) built from tensor-parallel layers.

The model runs on a flat batch: ``input_ids [T]`` and ``positions [T]`` -> hidden ``[T, H]``;
``compute_logits`` turns the rows the sampler needs into float32 logits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagellm.layers.activation import SiluAndMul
from pagellm.layers.attention import Attention
from pagellm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagellm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryEmbedding, get_rope
from pagellm.models.kv_scales import load_kv_scale

logger = logging.getLogger(__name__)


def get_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def load_checkpoint_tensor(param: nn.Parameter, tensor: torch.Tensor, shard: Any,
                           ckpt_name: str) -> None:
    """``param.weight_loader(param, tensor[, shard])``; a failure names the checkpoint tensor.
    Shared by the models' loaders and in-place updates (pagellm/worker/weight_update.py)."""
    try:
        if shard is None:
            param.weight_loader(param, tensor)  # type: ignore[attr-defined]
        else:
            param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"cannot load checkpoint tensor {ckpt_name!r} of shape "
                         f"{tuple(tensor.shape)}: {e}") from e


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str,
                 bias: bool = False) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding,
                 qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        head_dim = get_head_dim(config)
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, total_num_heads,
                                          total_num_kv_heads, bias=qkv_bias)
        self.q_size = self.qkv_proj.num_heads * head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(total_num_heads * head_dim, hidden_size, bias=o_bias)
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, self.qkv_proj.num_kv_heads,
                              head_dim**-0.5, layer_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding,
                 qkv_bias: bool, o_bias: bool,
                 attention_cls: type[LlamaAttention] = LlamaAttention,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx, rotary_emb, qkv_bias, o_bias)
        # ``mlp``: a family's own (a MoE block); None: the dense SiLU MLP.
        self.mlp = mlp if mlp is not None else LlamaMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act,
            bias=getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def rope_table_len(config: Any, max_model_len: int | None) -> int:
    """Rows of the rotary cos/sin table: every position the engine can schedule, which is past
    the config's max_position_embeddings when PAGELLM_ALLOW_LONG_MAX_MODEL_LEN allowed it."""
    return max(config.max_position_embeddings, max_model_len or 0)


class LlamaModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool,
                 max_model_len: int | None = None,
                 attention_cls: type[LlamaAttention] = LlamaAttention,
                 make_mlp: Callable[[Any, int], nn.Module | None] | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = get_rope(get_head_dim(config), rope_table_len(config, max_model_len),
                              config, max_model_len)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary_emb, qkv_bias, o_bias, attention_cls,
                              make_mlp(config, i) if make_mlp is not None else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # CPU steps as one kernel call where the linears took a fused-capable kernel, enabled after
        # loading (llama_cpu_fused.enable_fused_cpu_forward); None: always the modules.
        self.cpu_fused: Any = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.cpu_fused is not None:
            fused = self.cpu_fused.run(hidden, positions)
            if fused is not None:
                return fused
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # checkpoint projection -> (our fused parameter, shard id)
    stacked_params_mapping = (
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    )
    # A family with its own attention (Qwen3's q/k norm) names it here.
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        """``max_model_len``: the engine's context length (None: the config's)."""
        super().__init__()
        self.config = config
        qkv_bias, o_bias = self.attention_bias(config)
        self.model = LlamaModel(config, qkv_bias, o_bias, max_model_len, self.attention_cls,
                                self.make_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        attn = self.model.layers[0].self_attn.attn
        # What the runner needs to size the KV cache (per tensor-parallel rank).
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.max_position = rope_table_len(config, max_model_len)
        # Per layer: its sliding window (None: full attention), set before the layers build
        # their backends (on first use).
        self.layer_windows = self.layer_sliding_windows(config)
        for layer, window in zip(self.model.layers, self.layer_windows, strict=True):
            layer.self_attn.attn.sliding_window = window

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module | None:
        """Layer ``layer_idx``'s MLP when the family has its own (MoE); None: the dense one."""
        return None

    @staticmethod
    def attention_bias(config: Any) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @staticmethod
    def get_sliding_window(config: Any) -> int | None:
        window = getattr(config, "sliding_window", None)
        # 0 (a GGUF file without one) or a window past every position: full attention.
        if not window or window >= config.max_position_embeddings:
            return None
        return int(window)

    @staticmethod
    def recurrent_layers(config: Any) -> tuple[int, ...]:
        """Layers with recurrent state instead of KV (linear attention, Mamba): none here."""
        return ()

    @staticmethod
    def recurrent_state_shapes(config: Any, tp_size: int) -> tuple[tuple[tuple[int, ...], bool],
                                                                    ...]:
        """Per recurrent layer, its state tensors' ``(shape, float32)`` for one slot on one TP
        rank (see ModelConfig.recurrent_state_shapes)."""
        return ()

    @classmethod
    def layer_sliding_windows(cls, config: Any) -> list[int | None]:
        """Each layer's sliding window (None: full attention). A config's ``layer_types``
        (transformers 5: Qwen2's max_window_layers) says which layers slide; without it every
        layer does once the family has a window."""
        window = cls.get_sliding_window(config)
        types = getattr(config, "layer_types", None)
        n = int(config.num_hidden_layers)
        if window is None:
            return [None] * n
        if types:
            return [window if t == "sliding_attention" else None for t in types]
        return [window] * n

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def stacked_target(self, ckpt_name: str) -> tuple[str, int | str | None]:
        """(parameter name, shard id) of a checkpoint tensor: a q/k/v or gate/up projection goes
        to its fused parameter (``stacked_params_mapping``), anything else to its own name."""
        for part, fused, sid in self.stacked_params_mapping:
            if f".{part}." in ckpt_name:
                return ckpt_name.replace(f".{part}.", f".{fused}."), sid
        return ckpt_name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by their Hugging Face names; returns the parameters filled.

        Raises ValueError for a tensor with no home or one the model needs and the checkpoint
        lacks; a fused parameter (qkv, gate_up) counts as loaded only once every shard came.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards: dict[str, set[int | str]] = {}  # fused parameter -> shard ids loaded
        for ckpt_name, tensor in weights:
            if "rotary_emb.inv_freq" in ckpt_name:
                continue
            if ckpt_name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some tied checkpoints store the copy anyway
            if load_kv_scale(self, ckpt_name, tensor):
                continue  # an fp8 KV cache's scale (models/kv_scales.py)
            name, shard_id = self.stacked_target(ckpt_name)
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} matches no parameter of "
                                 f"{type(self).__name__}")
            load_checkpoint_tensor(param, tensor, shard_id, ckpt_name)
            if shard_id is None:
                loaded.add(name)
            else:
                shards.setdefault(name, set()).add(shard_id)
        missing = self._missing_tensors(params, loaded, shards)
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(f"{', '.join(missing[:8])}{more} missing from the checkpoint "
                             f"({type(self).__name__} needs them)")
        return set(params)

    def _missing_tensors(self, params: dict[str, nn.Parameter], loaded: set[str],
                         shards: dict[str, set[int | str]]) -> list[str]:
        """Checkpoint names of the tensors no parameter got, a fused one's by their own name."""
        missing = []
        for name in params:
            parts = [(part, fused, sid) for part, fused, sid in self.stacked_params_mapping
                     if f".{fused}." in name]
            if not parts:
                if name not in loaded:
                    missing.append(name)
                continue
            got = shards.get(name, set())
            missing += [name.replace(f".{fused}.", f".{part}.") for part, fused, sid in parts
                        if sid not in got]
        return sorted(missing)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral checkpoints use Llama's tensor names and layout."""
