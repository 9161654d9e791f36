"""Linear layers that shard themselves over the tensor-parallel group.

Each layer reads the tp rank/size at construction and allocates only its shard. Every parameter
carries a ``weight_loader(param, loaded_weight, shard_id=None)`` that takes the *full* checkpoint
tensor and copies this rank's slice into place, so a model's ``load_weights`` never needs to know
the tp degree. Column-parallel layers split the output dim (weight dim 0), row-parallel layers the
input dim (weight dim 1) and all-reduce their output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.communication import all_gather, tensor_model_parallel_all_reduce
from pagellm.distributed.parallel_state import get_tp_rank, get_tp_size
from pagellm.kernels import cpu_ops

if TYPE_CHECKING:
    from pagellm.layers.quant_methods import QuantMethod
    from pagellm.layers.quantization import QuantConfig

# Up to this many input rows the bf16 linears take the AMX kernel, beyond it torch's oneDNN
# matmul on the plain weight. Alone the kernel is ahead up to ~512 rows (1.5x with one row and
# the weights in memory, 1.1-1.7x at 64-256 rows, 1.0-1.25x at 320-512 with cold weights) and
# behind from ~1,024 (0.75-0.8x); steps up to this size also run as one fused call
# (llama_cpu_fused.py), which makes 640-1,024-token steps 5-20% faster than the modules with
# oneDNN, and 2,048-token steps slower (the offline workload 1.2x slower): figures in
# docs/performance.md. Where AMX does not serve (no AMX, or float32), the weights are packed
# for pagellm's AVX-512 kernel (cpu_linear_vec.cpp), which serves every row count: 1.05-1.3x
# oneDNN's prepacked matmul in bfloat16 and 1.0-1.2x in float32 on an AVX-512 AMD CPU.
AMX_LINEAR_MAX_ROWS = 1024

# Dtypes whose CPU weights get a matmul chosen at load (``prepack_for_cpu_``).
CPU_PACKED_DTYPES = (torch.bfloat16, torch.float32)


def amx_max_numel(weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The largest input (elements) ``cpu_ops.linear`` takes for this weight: 0 where it
    cannot serve it (see ``cpu_ops.linear_supports``; a bias must be bfloat16 too)."""
    if cpu_ops.linear_supports(weight) and (bias is None or bias.dtype == torch.bfloat16):
        return AMX_LINEAR_MAX_ROWS * weight.shape[1]
    return 0


def cpu_matmul_kind(weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """How a loaded CPU weight is best multiplied (``prepack_for_cpu_`` of the linears and the
    LM head): "amx" (``cpu_ops.linear`` on the weight as it is, up to ``amx_max_numel``),
    "packed" (``cpu_ops.linear_packed`` on ``cpu_ops.linear_pack``'s copy), "onednn" (torch's
    matmul on oneDNN's blocked layout), or None (left to ``F.linear``: other devices and dtypes,
    weights already packed, a bias of another dtype)."""
    if (weight.is_mkldnn or weight.device.type != "cpu"
            or weight.dtype not in CPU_PACKED_DTYPES):
        return None
    if amx_max_numel(weight, bias):
        return "amx"
    if bias is not None and bias.dtype != weight.dtype:
        return None
    if cpu_ops.linear_packed_supports(weight):
        return "packed"
    return "onednn" if torch.backends.mkldnn.is_available() else None


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


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.quant_method: QuantMethod | None = None  # set by quantize_
        # Chosen by prepack_for_cpu_: inputs up to amx_max_numel take cpu_ops.linear; with
        # cpu_packed, ``weight`` holds cpu_ops.linear_pack's layout and every input takes
        # cpu_ops.linear_packed.
        self.amx_max_numel = 0
        self.cpu_packed = False

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        raise NotImplementedError

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is None:
            if self.cpu_packed:
                return cpu_ops.linear_packed(x, self.weight, bias)
            if 0 < x.numel() <= self.amx_max_numel and x.dtype == torch.bfloat16:
                return cpu_ops.linear(x, self.weight, bias)
            if self.weight.is_mkldnn:
                return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
            return F.linear(x, self.weight, bias)
        return self.quant_method.apply(self, x, bias)

    @torch.no_grad()
    def prepack_for_cpu_(self) -> bool:
        """Choose the matmul of a CPU bfloat16 or float32 weight, once, after loading:
        bfloat16 with AMX (and the kernels built): ``cpu_ops.linear`` for up to
        ``AMX_LINEAR_MAX_ROWS`` input rows, on the weight as it is, and torch's matmul beyond
        (where oneDNN's per-call reorder of the plain weight costs little next to the product).
        Otherwise, with AVX-512: the weight packed once for ``cpu_ops.linear_packed``
        (``cpu_linear_vec.cpp``), which serves every input (faster than oneDNN's prepacked
        matmul at every size measured; bit-identical to it neither in bfloat16 nor float32:
        another summation order). Else the weight is reordered once into oneDNN's blocked
        layout (in bfloat16 1.1-1.6x faster than ``F.linear``; in float32 faster than MKL
        where that runs its AVX2 code, on AMD). Either packed weight is then opaque to
        everything but its matmul: it can no longer be loaded or quantized. Returns whether
        anything changed.
        """
        if self.quant_method is not None or self.cpu_packed:  # no plain float weight left
            return False
        w = self.weight.data
        kind = cpu_matmul_kind(w, self.bias)
        if kind == "amx":
            self.amx_max_numel = amx_max_numel(w, self.bias)
        elif kind == "packed":
            self.weight = nn.Parameter(cpu_ops.linear_pack(w), requires_grad=False)
            self.cpu_packed = True
        elif kind == "onednn":
            self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w),
                                       requires_grad=False)
        return kind is not None

    @torch.no_grad()
    def quantize_(self, config: QuantConfig, backend: str = "auto") -> int | None:
        """After loading: replace ``weight`` by quantized parameters (this rank's shard).

        Returns the int4 group size used (0 for int8), or None when the layer stays in float.
        """
        from pagellm.layers.quant_methods import make_quant_method
        from pagellm.layers.quantization import resolve_backend

        assert self.quant_method is None, "layer already quantized"
        if self.cpu_packed or self.weight.is_mkldnn:
            raise ValueError("this layer's weight is already packed for its CPU matmul: "
                             "quantize before prepack_for_cpu_")
        backend = resolve_backend(backend, self.weight.device)
        method = make_quant_method(config, self.weight.data, backend)
        if method is None:
            return None
        method.create(self, self.weight.data)
        del self.weight
        self.quant_method = method
        return method.group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


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
        _copy_checked(param, param.data, loaded.narrow(0, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.bias)
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
        _copy_checked(param, dst, loaded.narrow(0, self.tp_rank * size, size))


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
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        elif shard_id == "k":
            offset, size, rank = q_size, kv_size, self.tp_rank // self.num_kv_head_replicas
        elif shard_id == "v":
            offset, size = q_size + kv_size, kv_size
            rank = self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be q, k or v, got {shard_id!r}")
        dst = param.data.narrow(0, offset, size)
        _copy_checked(param, dst, loaded.narrow(0, rank * size, size))


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
        _copy_checked(param, param.data, loaded.narrow(1, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._matmul(x, self.bias)
        y = self._matmul(x, None)
        if self.reduce_results:
            y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


def prepack_linears_for_cpu(model: nn.Module) -> int:
    """``prepack_for_cpu_`` on every linear layer and LM head of ``model``; returns how many
    were packed. ``PAGELLM_CPU_KERNELS=0`` turns it off, with the other CPU speed-ups."""
    from pagellm.kernels.cpu_build import kernels_enabled
    from pagellm.layers.embedding import ParallelLMHead

    if not kernels_enabled():
        return 0
    return sum(m.prepack_for_cpu_() for m in model.modules()
               if isinstance(m, LinearBase | ParallelLMHead))
