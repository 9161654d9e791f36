"""The one place a linear layer's (or the LM head's) method is chosen."""

from __future__ import annotations

import torch

from pagellm.config import read_env
from pagellm.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod
from pagellm.layers.quant_methods import QUANT_METHODS
from pagellm.layers.quantization import QuantConfig, choose_group_size, resolve_backend


def _quantized_method(config: QuantConfig, weight: torch.Tensor,
                      backend: str) -> LinearMethodBase | None:
    backend = resolve_backend(backend, weight.device)
    n, k = weight.shape
    group = 0
    if config.method == "int4":
        group = choose_group_size(k, config.group_size)
        if group is None:
            return None
    if backend == "cpu" and weight.device.type != "cpu":
        raise ValueError(f"quantization backend 'cpu' needs CPU weights, got {weight.device}")
    if (backend == "triton" and weight.device.type == "cpu"
            and not read_env().triton_interpret):
        raise ValueError("quantization backend 'triton' needs CUDA (or TRITON_INTERPRET=1)")
    return QUANT_METHODS[backend][config.method](config.method, n, k, group, weight.dtype)


def make_linear_method(quant: QuantConfig | None = None, weight: torch.Tensor | None = None,
                       backend: str = "auto", *, weight_shared: bool = False
                       ) -> LinearMethodBase:
    """Float weights without ``quant`` (on CPU, their kernel is chosen after loading;
    ``weight_shared``: see ``UnquantizedLinearMethod``). With ``quant``: the quantized method for
    this rank's loaded float ``weight`` on ``backend`` ("auto": ``resolve_backend``), or the float
    one where none fits (int4 with no group dividing the input size)."""
    method = None
    if quant is not None:
        assert weight is not None, "quantizing needs the loaded weight"
        method = _quantized_method(quant, weight, backend)
    if method is None:
        method = UnquantizedLinearMethod(weight_shared)
    # LoRA goes here: a method wrapping ``method`` whose apply adds the adapters' product.
    return method
