"""``--kv-cache-dtype``: what the paged KV cache stores, with vLLM's names and meanings.

- ``auto``: the model's dtype (the default); ``bfloat16``/``float16``: that dtype.
- ``fp8`` (= ``fp8_e4m3``), ``fp8_e5m2``: one byte per value, divided by a per-tensor scale
  (1.0 unless the checkpoint carries ``k_scale``/``v_scale``, see attention/kv_quant.py).
- ``int8_per_token_head``: int8 values with one bfloat16 scale per (token, kv head), symmetric
  (absmax / 127), kept in a tensor of their own indexed by the same block ids.

Plain stdlib (read by the config, the planner and ``core/``, which import no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2",
                   "int8_per_token_head")
FLAG = "--kv-cache-dtype"
_ALIASES = {"fp8": "fp8_e4m3"}
# Bytes of the per-(token, kv head) scale beside an int8 row (bfloat16: with head_dim 64 the
# cache then holds 1.94x bf16's tokens, against 1.88x with float32 scales).
INT8_SCALE_BYTES = 2


@dataclass(frozen=True)
class KVCacheDtype:
    """A resolved ``--kv-cache-dtype``. ``name``: as given (``fp8`` stays ``fp8`` for the
    metrics label); ``kind``: the storage kind (``auto``, ``bfloat16``, ``float16``,
    ``fp8_e4m3``, ``fp8_e5m2``, ``int8_per_token_head``)."""

    name: str = "auto"

    @property
    def kind(self) -> str:
        return _ALIASES.get(self.name, self.name)

    @property
    def quantized(self) -> bool:
        """Whether values are stored in 8 bits (and dequantized by the attention kernels)."""
        return self.kind in ("fp8_e4m3", "fp8_e5m2", "int8_per_token_head")

    @property
    def per_token_head(self) -> bool:
        return self.kind == "int8_per_token_head"

    def element_bytes(self, model_dtype_bytes: int) -> int:
        if self.quantized:
            return 1
        if self.kind in ("bfloat16", "float16"):
            return 2
        return model_dtype_bytes

    def scale_bytes(self) -> int:
        """Bytes of scale per (token, kv head) beside the values (int8 per token-head only)."""
        return INT8_SCALE_BYTES if self.per_token_head else 0

    def hash_key(self) -> str | None:
        """The extra key a block's hash carries (core/block_hash.py): None for ``auto``, so
        existing hashes stay as they were; otherwise the storage kind (``fp8`` and
        ``fp8_e4m3`` hold the same bytes)."""
        return None if self.kind == "auto" else "kv_dtype=" + self.kind


def parse_kv_cache_dtype(value: str | None) -> KVCacheDtype:
    """``--kv-cache-dtype``'s value, checked (a ValueError names the flag)."""
    name = "auto" if value is None else str(value).strip().lower()
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"{FLAG} must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}.")
    return KVCacheDtype(name)


def check_kv_cache_dtype(kv: KVCacheDtype, attention_backend: str, device_type: str,
                         model_dtype: str) -> None:
    """Refuse, naming the flags, a KV dtype the chosen attention backend cannot read (nothing
    falls back to another dtype). The 8-bit dtypes are read by every backend; the Triton
    kernels (``--attention-backend triton``, or auto on CUDA) take a float cache only in the
    model's dtype (the torch and cpu backends convert). ``model_dtype``: the resolved --dtype
    (``float32``, ``bfloat16``, ``float16``)."""
    triton = attention_backend == "triton" or (attention_backend == "auto"
                                                and device_type == "cuda")
    if not triton or kv.kind == "auto" or kv.quantized or kv.kind == model_dtype:
        return
    raise ValueError(
        f"{FLAG} {kv.name} is not supported by the Triton attention backend with --dtype "
        f"{model_dtype} (it reads float KV caches in the model's dtype only): use {FLAG} auto "
        "or an 8-bit one, or --attention-backend torch.")
