"""The ctypes signatures of the CPU kernel library's C entry points (cpu_*.cpp), one table for
every wrapper module: ``cpu_ops`` types a library with it when it loads one (``built_for`` too).
"""

from __future__ import annotations

from ctypes import c_float, c_int, c_int64, c_void_p

# name -> argument types
SIGNATURES = {
    "pagellm_paged_attention": [c_int, c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_void_p,
                                 c_void_p, c_void_p, c_int64, c_void_p, c_void_p, c_int64,
                                 c_int64, c_int64, c_int64, c_int64, c_float, c_void_p],
    "pagellm_paged_attention_windowed": [c_int, c_void_p, c_int64, c_void_p, c_int64, c_void_p,
                                          c_void_p, c_void_p, c_void_p, c_int64, c_void_p,
                                          c_void_p, c_int64, c_int64, c_int64, c_int64, c_int64,
                                          c_float, c_int64, c_float, c_void_p],
    "pagellm_paged_attention_supported": [c_int, c_int64, c_int64, c_int64, c_int64],
    "pagellm_paged_attention_slices": [c_int, c_int64, c_int64, c_int64, c_int64, c_void_p],
    "pagellm_kernel_paths": [],
    "pagellm_linear_available": [],
    "pagellm_write_kv": [c_int, c_void_p, c_void_p, c_void_p, c_int64, c_void_p, c_int64,
                         c_void_p, c_int64, c_int64, c_int64],
    "pagellm_rms_norm": [c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int64,
                         c_int64, c_float],
    "pagellm_rotary": [c_int, c_void_p, c_int64, c_int64, c_void_p, c_int64, c_int64, c_void_p,
                       c_int64, c_void_p, c_void_p, c_int64, c_int64, c_int64],
    "pagellm_silu_and_mul": [c_int, c_void_p, c_void_p, c_int64, c_int64],
    "pagellm_argmax_rows": [c_int, c_void_p, c_void_p, c_int64, c_int64, c_int64],
    "pagellm_linear": [c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_void_p, c_int64,
                       c_int64, c_int64],
    "pagellm_linear_pack": [c_int, c_void_p, c_void_p, c_int64, c_int64],
    "pagellm_linear_packed": [c_int, c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_void_p,
                              c_int64, c_int64, c_int64],
    "pagellm_linear_packed_available": [c_int, c_int64, c_int64],
    "pagellm_llama_forward": [c_void_p, c_int64, c_void_p, c_void_p],
    "pagellm_prefill_attention": [c_int, c_void_p, c_int64, c_void_p, c_int64, c_void_p,
                                  c_void_p, c_void_p, c_int64, c_int64, c_void_p, c_void_p,
                                  c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64,
                                  c_float, c_void_p],
    "pagellm_prefill_attention_supported": [c_int, c_int64],
    "pagellm_moe_available": [c_int, c_int64, c_int64],
    "pagellm_moe_forward": [c_int, c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_void_p,
                            c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64, c_int64],
    "pagellm_moe_forward_int8": [c_int, c_void_p, c_int64, c_void_p, c_int64, c_void_p,
                                 c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int64,
                                 c_int64, c_int64, c_int64, c_int64],
    "pagellm_moe_forward_int4": [c_int, c_void_p, c_int64, c_void_p, c_int64, c_void_p,
                                 c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int64,
                                 c_int64, c_int64, c_int64, c_int64, c_int64],

    "pagellm_write_kv_quant": [c_int, c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
                               c_int64, c_void_p, c_int64, c_void_p, c_int64, c_int64, c_int64,
                               c_int64, c_float, c_float],
    "pagellm_paged_attention_quant": [c_int, c_int, c_void_p, c_int64, c_void_p, c_int64,
                                      c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
                                      c_int64, c_int64, c_void_p, c_void_p, c_void_p, c_void_p,
                                      c_int64, c_int64, c_int64, c_int64, c_float, c_int64,
                                      c_float, c_float, c_float, c_void_p],
    "pagellm_llama_forward_quant": [c_void_p, c_int64, c_void_p, c_void_p, c_void_p],
}

# Returning an int (a yes/no or a count); the other entry points return nothing.
RETURNS_INT = ("pagellm_linear_available", "pagellm_linear", "pagellm_linear_packed",
                "pagellm_linear_packed_available", "pagellm_llama_forward",
                "pagellm_prefill_attention", "pagellm_prefill_attention_supported",
                "pagellm_paged_attention", "pagellm_paged_attention_windowed",
                "pagellm_paged_attention_supported",
                "pagellm_paged_attention_slices", "pagellm_kernel_paths", "pagellm_write_kv",
                "pagellm_moe_available", "pagellm_moe_forward", "pagellm_moe_forward_int8",
                "pagellm_moe_forward_int4", "pagellm_write_kv_quant",
                "pagellm_paged_attention_quant", "pagellm_llama_forward_quant")
