"""Updating a loaded model's weights in place (RL rollouts: ``LLM.load_weights``).

After loading, each linear's method has turned its float weight into the layout its kernel
reads (packed for the AVX-512 kernel, oneDNN's, or int8/int4 codes). An update puts the
touched layers back into the float layout the loaders fill (the current contents recovered
where a fused layer gets only some of its shards), loads the new tensors through the same
``weight_loader``s (fusion, tensor-parallel slices), then re-runs
``process_weights_after_loading``: a quantized layer updated from float weights holds exactly
what one quantized from them at start-up would. Each re-made parameter (and an LM head's kernel
copy of a tied embedding) is copied back into the old one's storage where the layout allows:
pointers held elsewhere (CUDA graphs) stay valid, and on CPU the weights the kernels stream stay
side by side on 2 MiB pages (``gather_kernel_weights``); the fused step's tables are rebuilt.

Mixture-of-Experts weights (FusedMoE's stacked experts, the router) are float tensors: each
expert's tensor is copied into its slice in place, the names mapped by the model's own
``moe_target``. Quantized experts get their float stacks back first (dequantized) and afterwards
only the experts loaded into are quantized again, into the quantized stacks in place.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.fused_moe import FusedMoE
from pagellm.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod
from pagellm.layers.quant_methods import QuantizedLinearMethod
from pagellm.models.llama import load_checkpoint_tensor
from pagellm.models.llama_cpu_fused import enable_fused_cpu_forward
from pagellm.models.moe import MoeWeightsMixin


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """``cpu_ops.linear_pack``'s layout back to ``[N, K]`` (see its docstring)."""
    blocks, width = packed.shape
    k = width // 16
    if packed.dtype == torch.bfloat16:
        w = packed.view(blocks, k // 2, 16, 2).permute(0, 2, 1, 3)
    else:
        w = packed.view(blocks, k, 16).transpose(1, 2)
    return w.reshape(blocks * 16, k)


def _float_weight(layer: nn.Module, method: LinearMethodBase) -> torch.Tensor:
    """The layer's current weight as the loaders fill it: ``[N, K]`` in the model's dtype."""
    if isinstance(method, QuantizedLinearMethod):
        return method.dequantize(layer).to(method.dtype)
    w = layer.weight.data
    kind = method.cpu_kind if isinstance(method, UnquantizedLinearMethod) else None
    if kind == "packed" and not (isinstance(method, UnquantizedLinearMethod)
                                 and method.weight_shared):
        return _unpack(w)
    if w.is_mkldnn:
        return w.to_dense()
    return w.clone()


def _new_weight(layer: nn.Module, method: LinearMethodBase, whole: bool) -> nn.Parameter:
    """A float ``weight`` for the loaders: empty when the update covers all of it (``whole``),
    else holding the current values (a fused layer updated in part)."""
    if whole:
        dtype = method.dtype if isinstance(method, QuantizedLinearMethod) else layer.weight.dtype
        device = next(layer.parameters()).device
        w = torch.empty(layer.output_size, layer.input_size, dtype=dtype, device=device)
    else:
        w = _float_weight(layer, method).contiguous()
    weight = nn.Parameter(w, requires_grad=False)
    weight.weight_loader = layer.weight_loader
    return weight


def _to_float_layout(layer: nn.Module, whole: bool) -> dict[str, torch.Tensor]:
    """Give ``layer`` back a float ``weight`` the loaders can fill; returns its parameters as
    they were, and a weight-shared LM head's kernel copy (their storage is reused once the layer
    is processed again)."""
    method = layer.linear_method
    old: dict[str, torch.Tensor] = dict(layer.named_parameters(recurse=False))
    if isinstance(method, UnquantizedLinearMethod):
        if method.cpu is None:
            return old  # plain float weight: loaded in place
        if method._cpu_weight is not None:
            old[_KERNEL_COPY] = method._cpu_weight
        if not method.weight_shared:
            layer.weight = _new_weight(layer, method, whole)
        method.cpu, method._matmul, method._cpu_weight = None, F.linear, None
        return old
    if isinstance(method, QuantizedLinearMethod):
        weight = _new_weight(layer, method, whole)
        for name in old:
            if name != "bias":
                delattr(layer, name)
        layer.weight = weight
    return old


# _to_float_layout's key for the kernel copy a weight-shared LM head holds (not a parameter).
_KERNEL_COPY = "linear_method._cpu_weight"


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (not a.is_mkldnn and not b.is_mkldnn and (a.shape, a.dtype, a.device, a.stride())
            == (b.shape, b.dtype, b.device, b.stride()))


def _reuse_storage(layer: nn.Module, old: dict[str, torch.Tensor]) -> None:
    for name, new in list(layer.named_parameters(recurse=False)):
        prev = old.get(name)
        if prev is None or prev is new or not _same_layout(prev, new):
            continue
        prev.data.copy_(new.data)
        setattr(layer, name, prev)
    prev = old.get(_KERNEL_COPY)  # only an UnquantizedLinearMethod's
    fresh = layer.linear_method.kernel_weight(layer) if prev is not None else None
    if fresh is not None and _same_layout(prev, fresh):
        layer.linear_method.move_kernel_weight(layer, prev)


Shard = int | str | tuple[int, str] | None  # a weight_loader's shard id; (expert, w1|w3|w2)


def _target(model: nn.Module, ckpt_name: str) -> tuple[str, Shard]:
    """(parameter name, shard id) for a checkpoint name, as the model's ``load_weights`` maps it."""
    if isinstance(model, MoeWeightsMixin):  # experts; the MoE block's checkpoint name renamed
        ckpt_name, expert_shard = model.moe_target(ckpt_name)
        if expert_shard is not None:
            return ckpt_name, expert_shard
    return model.stacked_target(ckpt_name)


@torch.no_grad()
def update_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load ``(hf_name, tensor)`` pairs (all of the model's tensors or some) into ``model``;
    returns how many were loaded. Raises ValueError for a name with no parameter or expert (checked
    before anything changes) or a tensor of the wrong shape (those before it are loaded)."""
    tied = bool(getattr(model, "tie_word_embeddings", False))
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    todo: list[tuple[str, str, Shard, torch.Tensor]] = []
    for ckpt_name, tensor in weights:
        if "rotary_emb.inv_freq" in ckpt_name or (ckpt_name == "lm_head.weight" and tied):
            continue
        name, shard = _target(model, ckpt_name)
        owner, _, leaf = name.rpartition(".")
        # A quantized layer's float weight is gone until _to_float_layout gives it back.
        quantized = isinstance(getattr(modules.get(owner), "linear_method", None),
                               QuantizedLinearMethod) and leaf == "weight"
        quantized = quantized or (isinstance(modules.get(owner), FusedMoE)
                                  and modules[owner].quant is not None)
        if name not in params and not quantized:
            raise ValueError(f"weight {ckpt_name!r} matches no parameter of "
                             f"{type(model).__name__}")
        moe = modules.get(owner)
        if isinstance(moe, FusedMoE) and isinstance(shard, tuple) \
                and not 0 <= shard[0] < moe.num_experts:
            # The loader would refuse it too, but only after the tensors before it changed.
            raise ValueError(f"weight {ckpt_name!r} names expert {shard[0]}, but {owner} has "
                             f"experts 0..{moe.num_experts - 1}")
        todo.append((ckpt_name, name, shard, tensor))
    layers = {name.rpartition(".")[0] for _, name, _, _ in todo}
    if tied and "model.embed_tokens.weight" in {n for _, n, _, _ in todo}:
        layers.add("lm_head")  # its kernel reads a copy of the embedding table
    layers = {n for n in layers if isinstance(getattr(modules.get(n), "linear_method", None),
                                              LinearMethodBase)}
    # Weight shards each layer gets: all of a fused one's, or its only one (None).
    got: dict[str, set[Shard]] = {}
    for _, name, shard, _ in todo:
        if name.endswith(".weight"):
            got.setdefault(name.rpartition(".")[0], set()).add(shard)
    shards: dict[str, set[Shard]] = {}
    for _, fused, sid in getattr(model, "stacked_params_mapping", ()):
        shards.setdefault(fused, set()).add(sid)

    def whole(n: str) -> bool:
        return got.get(n, set()) >= shards.get(n.rpartition(".")[2], {None})

    old = {n: _to_float_layout(modules[n], whole(n)) for n in sorted(layers)}
    moes = [m for m in {name.rpartition(".")[0] for _, name, _, _ in todo}
            if isinstance(modules.get(m), FusedMoE)]
    for m in moes:
        modules[m].to_float_layout()
    try:
        fresh = dict(model.named_parameters())
        for ckpt_name, name, shard, tensor in todo:
            load_checkpoint_tensor(fresh[name], tensor, shard, ckpt_name)
    finally:
        # Even after an error: every layer back in its kernel's layout.
        for n, prev in old.items():
            layer = modules[n]
            layer.linear_method.process_weights_after_loading(layer)
            _reuse_storage(layer, prev)
        for m in moes:
            modules[m].process_weights_after_loading()
        enable_fused_cpu_forward(model)
    return len(todo)


# What must match for a checkpoint to load into the running model in place.
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "head_dim", "tie_word_embeddings")


def check_same_architecture(hf_config: object, model_path: str) -> list[str]:
    """The safetensors files of ``model_path`` when it is a Hugging Face checkpoint of the running
    model's architecture and shapes; else ValueError naming ``model_path``."""
    import os

    from pagellm.models.loader import ModelSource, load_hf_config
    from pagellm.models.weight_utils import _checkpoint_files

    path = os.path.expanduser(model_path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model_path {model_path!r} is not a folder with config.json (a Hugging "
                         "Face checkpoint)")
    try:
        config = load_hf_config(ModelSource(path=os.path.abspath(path), kind="hf"))
        files = _checkpoint_files(path)
    except Exception as e:
        raise ValueError(f"model_path {model_path!r}: cannot read the checkpoint: {e}") from e
    if not files:
        raise ValueError(f"model_path {model_path!r} holds no .safetensors files")
    want = getattr(hf_config, "architectures", None), *(getattr(hf_config, k, None)
                                                        for k in _SHAPE_KEYS)
    got = getattr(config, "architectures", None), *(getattr(config, k, None) for k in _SHAPE_KEYS)
    if want != got:
        diff = [f"{k}: {w} != {g}" for k, w, g in zip(("architectures", *_SHAPE_KEYS), want, got,
                                                      strict=True) if w != g]
        raise ValueError(f"model_path {model_path!r} is not a checkpoint of the running model's "
                         f"architecture ({'; '.join(diff)})")
    return files


def load_checkpoint(runner: object, files: list[str]) -> int:
    """``collective_rpc`` target: every rank reads the checkpoint itself (no tensors cross
    processes) and loads it as one update."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    return runner.load_weights(list(weights.items()))  # type: ignore[attr-defined]
