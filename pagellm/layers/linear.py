"""Linear layers that shard themselves over the tensor-parallel group.

Each layer reads the tp rank/size at construction and allocates only its shard. Every parameter
carries a ``weight_loader(param, loaded_weight, shard_id=None)`` that takes the *full* checkpoint
tensor and copies this rank's slice into place, so a model's ``load_weights`` never needs to know
the tp degree. Column-parallel layers split the output dim (weight dim 0), row-parallel layers the
input dim (weight dim 1) and all-reduce their output. The weight's layout and the matmul are
the layer's ``linear_method`` (linear_method.py, quant_methods.py), made by method_factory.py.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed.communication import all_gather, tensor_model_parallel_all_reduce
from pagellm.distributed.parallel_state import get_tp_rank, get_tp_size

# Re-exported (tests import it from here): the most rows the AMX kernel takes.
from pagellm.kernels.cpu_matmul import AMX_LINEAR_MAX_ROWS as AMX_LINEAR_MAX_ROWS
from pagellm.kernels.huge_pages import huge_page_slots
from pagellm.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod
from pagellm.layers.method_factory import make_linear_method
from pagellm.layers.quant_methods import QuantizedLinearMethod
from pagellm.layers.quantization import QuantConfig


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size "
                         f"({denominator})")
    return numerator // denominator


def _copy_checked(param: nn.Parameter, dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit parameter "
                         f"slot of shape {tuple(dst.shape)} (parameter {tuple(param.shape)})")
    dst.copy_(src)


def _rank_slice(loaded: torch.Tensor, dim: int, full: int, index: int, size: int) -> torch.Tensor:
    """Slice ``index`` (``size`` long) of ``loaded`` along ``dim``, which must be ``full`` long
    there: a checkpoint tensor that is itself only part (one tp shard) would otherwise fill some
    ranks and leave the others short, or a too-long one load its first rows silently."""
    if loaded.dim() <= dim or loaded.shape[dim] != full:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} should be {full} "
                         f"long in dim {dim} (the whole, unsharded tensor)")
    return loaded.narrow(dim, index * size, size)


class LinearBase(nn.Module):
    """Shards and loads; ``linear_method`` (one per layer) owns the weight's layout and math."""

    weight: nn.Parameter

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        dtype = params_dtype or torch.get_default_dtype()
        self.linear_method: LinearMethodBase = make_linear_method()  # float until quantize_
        self.linear_method.create_weights(self, input_size, output_size, dtype,
                                          self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    @property
    def quant_method(self) -> QuantizedLinearMethod | None:
        """The quantized method, or None while the weight is float."""
        method = self.linear_method
        return method if isinstance(method, QuantizedLinearMethod) else None

    @property
    def cpu_packed(self) -> bool:
        """Whether ``weight`` holds ``cpu_ops.linear_pack``'s layout (opaque but to its kernel)."""
        method = self.linear_method
        return isinstance(method, UnquantizedLinearMethod) and method.cpu_kind == "packed"

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def quantize_(self, config: QuantConfig, backend: str = "auto") -> int | None:
        """After loading: replace ``weight`` by quantized parameters (this rank's shard).

        Returns the int4 group size used (0 for int8), or None when the layer stays in float.
        """
        assert self.quant_method is None, "layer already quantized"
        if self.cpu_packed or self.weight.is_mkldnn:
            raise ValueError("this layer's weight is already packed for its CPU matmul: "
                             "quantize before prepack_linears_for_cpu")
        method = make_linear_method(config, self.weight.data, backend)
        if not isinstance(method, QuantizedLinearMethod):
            return None
        method.process_weights_after_loading(self)
        self.linear_method = method
        return method.group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        _copy_checked(param, param.data, loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; ``gather_output`` all-gathers the result."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False, params_dtype: torch.dtype | None = None) -> None:
        tp_size = get_tp_size()
        super().__init__(input_size, _divide(output_size, tp_size, "output size"), bias,
                         params_dtype)
        self.full_output_size = output_size
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        shard = param.data.size(0)
        _copy_checked(param, param.data,
                      _rank_slice(loaded, 0, self.full_output_size, self.tp_rank, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_method.apply(self, x, self.bias)
        return all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate + up).

    ``shard_id`` is the index of the sub-projection in ``output_sizes``; each rank's weight is the
    concatenation of its slice of every sub-projection.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, params_dtype=params_dtype)
        for size in self.output_sizes:
            _divide(size, self.tp_size, "merged projection size")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs a shard_id for each sub-projection")
        assert isinstance(shard_id, int)
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        dst = param.data.narrow(0, offset, size)
        full = self.output_sizes[shard_id]
        _copy_checked(param, dst, _rank_slice(loaded, 0, full, self.tp_rank, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused, heads split over ranks.

    When there are fewer KV heads than ranks, KV heads are replicated so every rank holds one.
    ``shard_id`` is "q", "k" or "v".
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        tp_size = get_tp_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = _divide(tp_size, total_num_kv_heads,
                                                "tensor_parallel_size over num_key_value_heads")
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias, params_dtype=params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        full_kv = self.total_num_kv_heads * self.head_size
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
            full = self.total_num_heads * self.head_size
        elif shard_id == "k":
            offset, size, rank = q_size, kv_size, self.tp_rank // self.num_kv_head_replicas
            full = full_kv
        elif shard_id == "v":
            offset, size = q_size + kv_size, kv_size
            rank, full = self.tp_rank // self.num_kv_head_replicas, full_kv
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be q, k or v, got {shard_id!r}")
        dst = param.data.narrow(0, offset, size)
        _copy_checked(param, dst, _rank_slice(loaded, 0, full, rank, size))


class RowParallelLinear(LinearBase):
    """Input features split over ranks; partial outputs are summed (all-reduce), then bias."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 reduce_results: bool = True, params_dtype: torch.dtype | None = None) -> None:
        tp_size = get_tp_size()
        super().__init__(_divide(input_size, tp_size, "input size"), output_size, bias,
                         params_dtype)
        self.full_input_size = input_size
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if param.dim() == 1:  # bias: added once, after the reduce
            _copy_checked(param, param.data, loaded)
            return
        shard = param.data.size(1)
        _copy_checked(param, param.data,
                      _rank_slice(loaded, 1, self.full_input_size, self.tp_rank, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.linear_method.apply(self, x, self.bias)
        y = self.linear_method.apply(self, x, None)
        if self.reduce_results:
            y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


def prepack_linears_for_cpu(model: nn.Module) -> int:
    """After loading (and quantizing): ``process_weights_after_loading`` of every linear's and
    LM head's method, which on CPU gives each float weight its kernel (kernels/cpu_matmul.py);
    returns how many changed. ``PAGELLM_CPU_KERNELS=0`` leaves them to ``F.linear``."""
    count = 0
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if isinstance(method, LinearMethodBase):
            count += method.process_weights_after_loading(module)
    if count:
        gather_kernel_weights(model)
    return count


def gather_kernel_weights(model: nn.Module) -> int:
    """Move the weights the CPU kernels stream side by side onto 2 MiB pages, in module order
    (the order a step reads them), so batch-1 decode reads the model as one stream
    (kernels/huge_pages.py); returns how many moved. One at a time: no second copy of the model
    is ever held."""
    movable = [m for m in model.modules()
               if isinstance(getattr(m, "linear_method", None), UnquantizedLinearMethod)
               and m.linear_method.kernel_weight(m) is not None]
    specs = [(tuple(w.shape), w.dtype) for w in (m.linear_method.kernel_weight(m) for m in movable)]
    for module, slot in zip(movable, huge_page_slots(specs), strict=True):
        module.linear_method.move_kernel_weight(module, slot)
    return len(movable)
