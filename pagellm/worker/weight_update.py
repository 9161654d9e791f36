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

An update is all or nothing. ``plan_update`` checks all of it before any weight changes (names,
floating-point dtypes, each tensor's whole unsharded shape as its loader takes it; for
``update_weights_from_disk`` from the safetensors headers, before any data is read:
weight_checkpoint.py): ValueError.
Then ``WeightBackup`` keeps the touched modules as they were (a copy of exactly the parameters
the update touches, on their device: see its docstring for the memory), and a failure once
weights are changing restores them (WeightUpdateError, ``restored=True``; ``False`` when even
that failed). Tensor-parallel ranks stage their updates and the engine commits or rolls back
all of them together (EngineCore._update, ModelRunner.stage_weights / end_weight_update).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.errors import WeightUpdateError
from pagellm.layers.embedding import VocabParallelEmbedding
from pagellm.layers.fused_moe import FusedMoE
from pagellm.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagellm.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod
from pagellm.layers.quant_methods import QuantizedLinearMethod
from pagellm.models.llama import load_checkpoint_tensor
from pagellm.models.llama_cpu_fused import enable_fused_cpu_forward
from pagellm.models.moe import MoeWeightsMixin

logger = logging.getLogger("pagellm")


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


# ---- checking an update before anything changes --------------------------------------------

def _linear_shape(layer: LinearBase, leaf: str, shard: Shard) -> tuple[int, ...] | None:
    """The whole checkpoint tensor ``layer``'s weight_loader takes for ``leaf`` and ``shard``
    (tensor parallelism slices it itself); None when it takes none. From the layer's sizes, not
    its parameter: a quantized or packed layer's float weight is gone."""
    if leaf not in ("weight", "bias") or (leaf == "bias" and layer.bias is None):
        return None
    if isinstance(layer, QKVParallelLinear):
        if shard not in ("q", "k", "v"):
            return None
        heads = layer.total_num_heads if shard == "q" else layer.total_num_kv_heads
        rows, cols = heads * layer.head_size, layer.input_size
    elif isinstance(layer, MergedColumnParallelLinear):
        if type(shard) is not int or not 0 <= shard < len(layer.output_sizes):
            return None
        rows, cols = layer.output_sizes[shard], layer.input_size
    elif shard is not None:
        return None  # only fused layers take shards
    elif isinstance(layer, ColumnParallelLinear):
        rows, cols = layer.full_output_size, layer.input_size
    elif isinstance(layer, RowParallelLinear):
        rows, cols = layer.output_size, layer.full_input_size
    else:  # replicated
        rows, cols = layer.output_size, layer.input_size
    return (rows, cols) if leaf == "weight" else (rows,)


def _checkpoint_shape(module: nn.Module | None, leaf: str, shard: Shard,
                      param: nn.Parameter | None) -> tuple[int, ...] | None:
    """The shape of the checkpoint tensor that ``module.<leaf>``'s weight_loader takes with
    ``shard`` (the whole, unsharded tensor); None when no loader takes one there."""
    if isinstance(module, FusedMoE):
        if leaf not in ("w13_weight", "w2_weight") or not isinstance(shard, tuple):
            return None  # experts load one expert's tensor at a time, never the stacks
        h, full = module.hidden_size, module.intermediate_size
        return (h, full) if shard[1] == "w2" else (full, h)
    if isinstance(module, LinearBase):
        return _linear_shape(module, leaf, shard)
    if isinstance(module, VocabParallelEmbedding):  # and the LM head
        if shard is not None or getattr(module, leaf, None) is None:
            return None
        if leaf == "weight":
            return module.num_embeddings, module.embedding_dim
        return (module.num_embeddings,) if leaf == "bias" else None
    if module is None or shard is not None or param is None \
            or not hasattr(param, "weight_loader"):
        return None
    return tuple(param.shape)  # replicated: norms, the router


def _model_names(model: nn.Module, weights: list[tuple[str, torch.Tensor]]
                 ) -> list[tuple[str, torch.Tensor]]:
    """The tensors as the model's loaders take them, by the model's own ``checkpoint_weights``
    (Phi-3's fused q/k/v split, Qwen3.5's language-model prefix dropped, Granite's stacked
    experts apart, ...; on meta tensors too, for a check from the headers)."""
    names = getattr(model, "checkpoint_weights", None)
    return list(names(weights)) if callable(names) else weights


@dataclass(frozen=True, slots=True)
class _Load:
    ckpt_name: str
    name: str  # the parameter (a quantized layer's float weight: _to_float_layout makes it)
    shard: Shard
    tensor: torch.Tensor
    given: int  # the index of the pair it came from (Phi-3 splits one into parts)


def plan_update(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> list[_Load]:
    """Check a whole update before any weight changes: every name maps to a parameter (or an
    expert) of ``model``, every tensor is floating point and has the shape that parameter's
    loader takes (the whole, unsharded tensor). Tensors may be on the meta device (a check from a
    checkpoint's headers). Raises ValueError naming the first bad tensor (names first, then
    dtypes and shapes); the message holds only the caller's names and shapes."""
    model_name = type(model).__name__
    pairs: list[tuple[str, torch.Tensor]] = []
    for item in weights:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ValueError("weights must be (name, tensor) pairs")
        pairs.append((item[0], item[1]))
    tied = bool(getattr(model, "tie_word_embeddings", False))
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    todo: list[tuple[_Load, tuple[int, ...]]] = []
    parts = [(i, part) for i, pair in enumerate(pairs) for part in _model_names(model, [pair])]
    for given, (ckpt_name, tensor) in parts:
        if "rotary_emb.inv_freq" in ckpt_name:
            continue
        skip = ckpt_name == "lm_head.weight" and tied  # the embedding's copy: not loaded
        name, shard = ("lm_head.weight", None) if skip else _target(model, ckpt_name)
        owner, _, leaf = name.rpartition(".")
        module = modules.get(owner)
        want = _checkpoint_shape(module, leaf, shard, params.get(name))
        if want is None:
            raise ValueError(f"weight {ckpt_name!r} matches no parameter of {model_name}")
        if isinstance(module, FusedMoE) and isinstance(shard, tuple) \
                and not 0 <= shard[0] < module.num_experts:
            raise ValueError(f"weight {ckpt_name!r} names expert {shard[0]}, but {owner} has "
                             f"experts 0..{module.num_experts - 1}")
        todo.append((_Load(ckpt_name, "" if skip else name, shard, tensor, given), want))
    for load, want in todo:
        t = load.tensor
        if not t.dtype.is_floating_point:
            raise ValueError(f"weight {load.ckpt_name!r} has dtype "
                             f"{str(t.dtype).removeprefix('torch.')}; the model's weights take "
                             "floating-point tensors")
        if tuple(t.shape) != want:
            raise ValueError(f"weight {load.ckpt_name!r} has shape {tuple(t.shape)}, expected "
                             f"{want}")
    return [load for load, _ in todo if load.name]


# ---- the backup an update restores on failure ----------------------------------------------

# nn.Module's own attributes; the rest of a module's __dict__ is its subclass's state.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _shallow(value: Any) -> Any:
    return copy.copy(value) if isinstance(value, dict | list | set) else value


class WeightBackup:
    """The touched modules as they were before an update: their parameters (the same objects,
    and a copy of each one's contents), their own attributes, and those of their linear method
    or experts' quantized method (layouts, kernel choices, a kernel's copy of a weight).
    ``restore`` puts all of it back, so the model is again exactly what it was, down to the
    storage every kernel and CUDA graph reads.

    Memory: one copy of every parameter of the touched modules (and of an LM head's kernel copy
    of a tied embedding), in its current layout (packed, int8/int4 codes), on its device, held
    until the update is committed or restored: for a full update about the weights' size once
    more. oneDNN (mkldnn) weights are not copied: an update never writes into them."""

    def __init__(self, model: nn.Module, modules: Iterable[nn.Module]) -> None:
        self.model = model
        self.states: list[tuple[nn.Module, dict[str, Any], dict[str, Any]]] = []
        self.objects: list[tuple[object, dict[str, Any]]] = []
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by id: shared once
        for m in modules:
            attrs = {k: _shallow(v) for k, v in vars(m).items() if k not in _MODULE_INTERNALS}
            self.states.append((m, dict(m._parameters), attrs))
            self._copy(m._parameters.values())
            objects = [getattr(m, "linear_method", None), getattr(m, "quant", None)]
            objects += list(getattr(objects[1], "methods", {}).values())
            for obj in objects:
                if obj is not None and hasattr(obj, "__dict__"):
                    saved = {k: _shallow(v) for k, v in vars(obj).items()}
                    self.objects.append((obj, saved))
                    self._copy(saved.values())

    def _copy(self, values: Iterable[Any]) -> None:
        for t in values:
            if isinstance(t, torch.Tensor) and not t.is_mkldnn and id(t) not in self.copies:
                self.copies[id(t)] = (t, t.detach().clone())

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for _, c in self.copies.values())

    @torch.no_grad()
    def restore(self) -> None:
        for m, params, attrs in self.states:
            m._parameters.clear()
            m._parameters.update(params)
            for k in [k for k in vars(m) if k not in _MODULE_INTERNALS and k not in attrs]:
                delattr(m, k)  # made by the failed update
            vars(m).update({k: _shallow(v) for k, v in attrs.items()})
        for obj, saved in self.objects:
            vars(obj).clear()
            vars(obj).update({k: _shallow(v) for k, v in saved.items()})
        for t, saved in self.copies.values():
            t.detach().copy_(saved)
        enable_fused_cpu_forward(self.model)


# ---- the update ------------------------------------------------------------------------------

_RESTORED = ("The weight update failed (the cause is in the server's log); the previous weights "
             "were restored and the engine serves them.")
_OUT_OF_SERVICE = ("The weight update failed and the previous weights could not be restored: the "
                   "engine is out of service (every request fails until it is restarted).")


def _touched(model: nn.Module, todo: list[_Load], modules: dict[str, nn.Module]
             ) -> tuple[set[str], list[str], list[str]]:
    """(modules whose state the update changes, its linear layers, its MoE modules)."""
    owners = {load.name.rpartition(".")[0] for load in todo}
    if getattr(model, "tie_word_embeddings", False) \
            and "model.embed_tokens.weight" in {load.name for load in todo}:
        owners.add("lm_head")  # its kernel reads a copy of the embedding table
    owners = {n for n in owners if n in modules}
    layers = sorted(n for n in owners
                    if isinstance(getattr(modules[n], "linear_method", None), LinearMethodBase))
    moes = sorted(n for n in owners if isinstance(modules[n], FusedMoE))
    return owners, layers, moes


def _load(model: nn.Module, todo: list[_Load], modules: dict[str, nn.Module],
          layers: list[str], moes: list[str]) -> None:
    """The update proper: touched layers to the loaders' float layout, the tensors loaded,
    every touched layer back in its kernel's layout (into its old storage where it fits)."""
    # Weight shards each layer gets: all of a fused one's, or its only one (None).
    got: dict[str, set[Shard]] = {}
    for load in todo:
        if load.name.endswith(".weight"):
            got.setdefault(load.name.rpartition(".")[0], set()).add(load.shard)
    shards: dict[str, set[Shard]] = {}
    for _, fused, sid in getattr(model, "stacked_params_mapping", ()):
        shards.setdefault(fused, set()).add(sid)

    def whole(n: str) -> bool:
        return got.get(n, set()) >= shards.get(n.rpartition(".")[2], {None})

    old = {n: _to_float_layout(modules[n], whole(n)) for n in layers}
    for m in moes:
        modules[m].to_float_layout()
    fresh = dict(model.named_parameters())
    for load in todo:
        load_checkpoint_tensor(fresh[load.name], load.tensor, load.shard, load.ckpt_name)
    for n, prev in old.items():
        layer = modules[n]
        layer.linear_method.process_weights_after_loading(layer)
        _reuse_storage(layer, prev)
    for m in moes:
        modules[m].process_weights_after_loading()
    enable_fused_cpu_forward(model)


@torch.no_grad()
def stage_update(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> tuple[int, WeightBackup]:
    """Load ``(hf_name, tensor)`` pairs (all of the model's tensors or some) into ``model``, all
    or nothing: returns how many were loaded and the backup of what they replaced (drop it to
    commit, or ``restore()`` it: another rank failed).

    Raises ValueError, with nothing changed, for an update ``plan_update`` refuses; and
    WeightUpdateError for a failure once weights were changing (the backup then restored:
    ``restored=True``, or ``restored=False`` if even that failed) or taking the backup. The
    cause goes to the log, not into the message. The backup's memory: see WeightBackup."""
    todo = plan_update(model, weights)
    modules = dict(model.named_modules())
    owners, layers, moes = _touched(model, todo, modules)
    try:
        backup = WeightBackup(model, [modules[n] for n in sorted(owners)])
    except Exception as e:
        logger.error("Weight update: cannot back up the %d module(s) it changes (%s: %s); "
                     "nothing was changed", len(owners), type(e).__name__, e, exc_info=e)
        raise WeightUpdateError("The weight update failed before any weight changed (no memory "
                                "for its backup); the engine serves the previous weights.",
                                restored=True) from e
    logger.debug("Weight update of %d tensor(s): a backup of %.1f MiB", len(todo),
                 backup.nbytes / 2**20)
    try:
        _load(model, todo, modules, layers, moes)
    except BaseException as e:
        logger.error("Weight update of %d tensor(s) failed (%s: %s); restoring the previous "
                     "weights", len(todo), type(e).__name__, e, exc_info=e)
        try:
            backup.restore()
        except BaseException as restore_error:
            logger.critical("Restoring the weights after a failed update failed too (%s: %s)",
                            type(restore_error).__name__, restore_error, exc_info=restore_error)
            raise WeightUpdateError(_OUT_OF_SERVICE, restored=False) from e
        if not isinstance(e, Exception):
            raise  # KeyboardInterrupt and the like: restored, and on their way
        raise WeightUpdateError(_RESTORED, restored=True) from e
    return len({load.given for load in todo}), backup


def update_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """``stage_update`` committed at once (one process): returns how many tensors were loaded;
    raises ValueError (nothing changed) or WeightUpdateError (see stage_update)."""
    n, _ = stage_update(model, weights)
    return n
