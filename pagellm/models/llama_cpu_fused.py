"""Steps of a Llama-style model on CPU as one kernel call (``cpu_ops.llama_forward``).

At batch 1 the Python around each op (module calls, kernel wrappers, allocations) costs as
much as reading the weights, and it stays a fixed cost per step at any size (figures:
docs/attention.md). For a step (decode tokens, prefill chunks or both) whose projections
one linear kernel serves, the C++ side runs the layers' own kernels in the modules' order, so
the hidden states are bit-identical to the module path. Two kinds qualify: bfloat16 weights on
the AMX kernel (steps of up to ``AMX_LINEAR_MAX_ROWS`` tokens), and bfloat16 or float32 weights
packed for the AVX-512 kernel (``cpu_linear_vec.cpp``; steps of any size). Every other step
still takes the modules (more rows than AMX serves, a head size the prefill kernel does not
take, other devices and dtypes, quantized or sharded layers, subclassed layers).
``PAGELLM_FUSED_CPU=0`` turns it off (``PAGELLM_CPU_KERNELS=0`` does too).
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from pagellm.attention.cpu_backend import CpuAttentionBackend, plan_step, quant_seqs
from pagellm.config import read_env
from pagellm.forward_context import get_forward_context
from pagellm.kernels import cpu_kv_quant, cpu_ops
from pagellm.kernels.cpu_matmul import AMX_LINEAR_MAX_ROWS
from pagellm.kernels.cpu_ops import ptr
from pagellm.layers.activation import SiluAndMul
from pagellm.layers.linear import LinearBase
from pagellm.layers.linear_method import UnquantizedLinearMethod
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryEmbedding
from pagellm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel

logger = logging.getLogger(__name__)


def fused_cpu_enabled() -> bool:
    return read_env().fused_cpu


def _linear_kind(m: LinearBase, dtype: torch.dtype) -> str | None:
    """"amx" (plain bfloat16 weight on the AMX kernel), "packed" (cpu_ops.linear_packed), or
    None where the fused path cannot run this layer (quantized, sharded, another kernel)."""
    method = m.linear_method
    if (type(method) is not UnquantizedLinearMethod or m.tp_size != 1
            or not (m.bias is None or m.bias.is_contiguous())):
        return None
    kind = method.cpu_kind
    if kind == "packed" and m.weight.dtype == dtype:
        return "packed"
    # "amx": the weight (and a bias, if any) passed cpu_ops.linear's checks.
    if kind == "amx" and dtype == torch.bfloat16:
        return "amx"
    return None


def _plain(cls: type, obj: object) -> bool:
    """``obj`` runs ``cls``'s own forward (a subclass may change what a layer computes)."""
    return isinstance(obj, cls) and type(obj).forward is cls.forward


class LlamaCpuFused:
    """The kernel call's fixed arguments for one ``LlamaModel``; ``run`` takes a step."""

    def __init__(self, model: LlamaModel, kind: str) -> None:
        self.model = model
        self.dtype = model.norm.weight.dtype
        first = model.layers[0]
        attn = first.self_attn.attn
        rotary = first.self_attn.rotary_emb
        self.rotary = rotary
        self.shape = cpu_ops.LlamaShape(
            hidden=first.input_layernorm.weight.shape[0], num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate=first.mlp.down_proj.input_size, rot_dim=2 * rotary.cos_cache.shape[1],
            max_pos=rotary.cos_cache.shape[0], block_size=0, eps=model.norm.eps, scale=attn.scale,
            dtype=cpu_ops.dtype_code(self.dtype), packed=int(kind == "packed"))
        # The AMX kernel serves up to AMX_LINEAR_MAX_ROWS rows; the packed one any number.
        self.max_tokens = AMX_LINEAR_MAX_ROWS if kind == "amx" else None
        self._kv_caches: list | None = None
        self._kv_quant: list | None = None
        self._layers: ctypes.Array | None = None
        self._quant_layers: ctypes.Array | None = None  # with 8-bit caches (KVQuantLayer)
        self._quant_fmt = 0
        self._num_blocks = 0  # blocks of every layer's cache (the kernels' bound on block ids)
        # Steps with prefill chunks need the prefill kernel for this head size.
        self.prefill_ok = cpu_ops.prefill_head_dim_supported(attn.head_dim, self.dtype)

    @classmethod
    def build(cls, model: LlamaModel) -> LlamaCpuFused | None:
        """The fused path for ``model``, or None where any layer is not one it reproduces."""
        if not (fused_cpu_enabled() and _plain(LlamaModel, model) and len(model.layers)
                and _plain(RMSNorm, model.norm)):
            return None
        dtype = model.norm.weight.dtype
        if not cpu_ops.dtype_supported(dtype):
            return None
        first = model.layers[0].self_attn
        attn0 = first.attn
        kinds = set()
        for layer in model.layers:
            sa, mlp = layer.self_attn, layer.mlp
            # A family's own MLP (a MoE block) has no gate_up/down the kernel could run.
            if not (_plain(LlamaMLP, mlp) and _plain(LlamaAttention, sa)):
                return None
            attn = sa.attn
            linears = (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ok = (_plain(LlamaDecoderLayer, layer) and _plain(LlamaAttention, sa)
                  and _plain(LlamaMLP, mlp) and _plain(SiluAndMul, mlp.act_fn)
                  and all(isinstance(m, LinearBase) for m in linears)
                  and all(_plain(RMSNorm, n) and n.eps == model.norm.eps
                          and n.weight.dtype == dtype and n.weight.is_contiguous()
                          for n in (layer.input_layernorm, layer.post_attention_layernorm))
                  and sa.rotary_emb is first.rotary_emb and _plain(RotaryEmbedding, sa.rotary_emb)
                  and isinstance(attn.get_backend(torch.device("cpu")), CpuAttentionBackend)
                  # The fused kernel attends to every earlier key, uncapped.
                  and attn.sliding_window is None and attn.logits_soft_cap is None
                  and (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)
                  == (attn0.num_heads, attn0.num_kv_heads, attn0.head_dim, attn0.scale))
            if not ok:
                return None
            kinds.update(_linear_kind(m, dtype) for m in linears)
        if len(kinds) != 1 or None in kinds:
            return None
        for table in (first.rotary_emb.cos_cache, first.rotary_emb.sin_cache):
            if not (table.dtype == torch.float32 and table.is_cpu and table.is_contiguous()):
                return None
        return cls(model, kinds.pop())

    def _layer_table(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     kv_quant: list | None) -> bool:
        """Point the layer table at these caches (rebuilt when the runner's lists change); with
        8-bit caches (``kv_quant``: the layers' KVQuant) the quantized kernels' table too."""
        if kv_caches is self._kv_caches and kv_quant is self._kv_quant:
            return self._layers is not None
        self._kv_caches, self._kv_quant, self._layers = kv_caches, kv_quant, None
        layers = self.model.layers
        if len(kv_caches) < len(layers):
            return False
        table = (cpu_ops.LlamaLayer * len(layers))()
        quant_table = None if kv_quant is None else (cpu_kv_quant.KVQuantLayer * len(layers))()
        kinds = set()
        for i, layer in enumerate(layers):
            idx = layer.self_attn.attn.layer_idx
            k, v = kv_caches[idx]
            if kv_quant is not None:
                quant = kv_quant[idx]
                if quant is None or not cpu_kv_quant.fused_supports(k, v, quant):
                    return False
                kinds.add(quant.kind)
                quant_table[i] = cpu_kv_quant.layer_state(quant)
            elif k.dtype != self.dtype:
                return False
            if not (k.dtype == v.dtype and k.is_cpu and k.is_contiguous()
                    and v.is_contiguous() and k.shape == v.shape
                    and k.shape[:2] == kv_caches[0][0].shape[:2]
                    and k.shape[-2:] == (self.shape.num_kv_heads,
                                                               self.shape.head_dim)):
                return False
            sa, mlp = layer.self_attn, layer.mlp
            table[i] = cpu_ops.LlamaLayer(
                input_norm=ptr(layer.input_layernorm.weight), qkv=ptr(sa.qkv_proj.weight),
                qkv_bias=ptr(sa.qkv_proj.bias), o=ptr(sa.o_proj.weight),
                o_bias=ptr(sa.o_proj.bias), post_norm=ptr(layer.post_attention_layernorm.weight),
                gate_up=ptr(mlp.gate_up_proj.weight), gate_up_bias=ptr(mlp.gate_up_proj.bias),
                down=ptr(mlp.down_proj.weight), down_bias=ptr(mlp.down_proj.bias),
                k_cache=ptr(k), v_cache=ptr(v))
            self.shape.block_size = k.shape[1]
            self._num_blocks = k.shape[0]
        if len(kinds) > 1:
            return False
        if kinds:
            self._quant_fmt = cpu_kv_quant.FORMATS[kinds.pop()]
        self._layers, self._quant_layers = table, quant_table
        return True

    def run(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The final hidden states of a step (``hidden``: its embeddings, reused), or None when
        this step is not one the fused path takes."""
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        num_tokens = hidden.shape[0]
        # An 8-bit --kv-cache-dtype (ctx.kv_quant) writes and attends through the quantized
        # cache's kernels (kernels/cpu_kv_quant.cpp), which take every step's chunks.
        if (meta is None or num_tokens != meta.num_tokens or num_tokens <= 0
                or (self.max_tokens is not None and num_tokens > self.max_tokens)
                or hidden.dtype != self.dtype or not hidden.is_contiguous()
                or not self._layer_table(ctx.kv_caches, ctx.kv_quant)):
            return None
        plan = plan_step(meta)
        if plan.prefill_seqs and not self.prefill_ok and ctx.kv_quant is None:
            return None
        s = self.shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim

        def scratch(width: int) -> torch.Tensor:
            return torch.empty((num_tokens, width), dtype=self.dtype)

        residual, normed = scratch(s.hidden), scratch(s.hidden)
        qkv, attn = scratch(q_size + 2 * kv_size), scratch(q_size)
        gate_up, act = scratch(2 * s.intermediate), scratch(s.intermediate)
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping[:num_tokens].to(torch.int64).contiguous()
        tables = plan.block_tables
        step = cpu_ops.ForwardStep(
            num_tokens=num_tokens, hidden=hidden.data_ptr(), residual=residual.data_ptr(),
            normed=normed.data_ptr(), qkv=qkv.data_ptr(), attn=attn.data_ptr(),
            gate_up=gate_up.data_ptr(), act=act.data_ptr(), positions=positions.data_ptr(),
            slots=slots.data_ptr(), cos_cache=self.rotary.cos_cache.data_ptr(),
            sin_cache=self.rotary.sin_cache.data_ptr(), block_tables=tables.data_ptr(),
            bt_stride=tables.stride(0), lens=plan.lens.data_ptr(),
            bt_rows=plan.bt_rows.data_ptr(), token_rows=plan.token_rows.data_ptr(),
            num_items=plan.lens.numel(), final_norm=self.model.norm.weight.data_ptr(),
            num_prefill=plan.prefill_rows.numel(), prefill_rows=plan.prefill_rows.data_ptr(),
            prefill_lens=plan.prefill_lens.data_ptr(), prefill_ctx=plan.prefill_ctx.data_ptr(),
            prefill_bt_rows=plan.prefill_bt_rows.data_ptr(), num_blocks=self._num_blocks,
            bt_height=tables.shape[0], bt_width=tables.shape[1])
        if ctx.kv_quant is None:
            cpu_ops.llama_forward(self._layers, s, step)
            return hidden
        q_rows, q_lens, seq_lens, bt_rows = quant_seqs(plan)
        quant = cpu_kv_quant.KVQuantStep(
            fmt=self._quant_fmt, layers=ctypes.addressof(self._quant_layers),
            num_seqs=q_rows.numel(), q_rows=q_rows.data_ptr(), q_lens=q_lens.data_ptr(),
            seq_lens=seq_lens.data_ptr(), bt_rows=bt_rows.data_ptr())
        cpu_kv_quant.llama_forward(self._layers, s, step, quant)
        return hidden


def enable_fused_cpu_forward(model: nn.Module) -> int:
    """Give every ``LlamaModel`` in ``model`` its fused path where it qualifies (after the
    linears chose their matmul: ``prepack_linears_for_cpu``); returns how many did."""
    count = 0
    for m in model.modules():
        if isinstance(m, LlamaModel):
            m.cpu_fused = LlamaCpuFused.build(m)
            count += m.cpu_fused is not None
    if count:
        logger.info("Fused CPU forward enabled for %d model(s)", count)
    return count
