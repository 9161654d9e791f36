"""A checkpoint folder as a weight update (``update_weights_from_disk``): which folders qualify
(a Hugging Face checkpoint of the running model's architecture and shapes), their tensors' names,
dtypes and shapes from the safetensors headers alone, and reading them on each rank. Every path
problem gets one message naming ``model_path`` and nothing the path holds; the reason is logged.
The update itself, all or nothing: weight_update.py.
"""

from __future__ import annotations

import logging
import os

import torch

from pagellm.worker.weight_update import plan_update

logger = logging.getLogger("pagellm")


# What must match for a checkpoint to load into the running model in place.
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "head_dim", "tie_word_embeddings")


def _not_loadable(model_path: str) -> ValueError:
    """The one answer for every path problem: a client learns no more about what a path on the
    server holds (the reason goes to the log)."""
    return ValueError(f"model_path {model_path!r} is not a loadable checkpoint of this model (a "
                      "folder with config.json and .safetensors files of the running model's "
                      "architecture)")


def check_same_architecture(hf_config: object, model_path: str) -> list[str]:
    """The safetensors files of ``model_path`` when it is a Hugging Face checkpoint of the running
    model's architecture and shapes; else ValueError naming ``model_path`` (the same message
    whatever is wrong; the reason is logged)."""
    from pagellm.models.loader import ModelSource, load_hf_config
    from pagellm.models.weight_utils import _checkpoint_files

    path = os.path.expanduser(model_path)
    reason = None
    if not os.path.isfile(os.path.join(path, "config.json")):
        reason = "no config.json"
    else:
        try:
            config = load_hf_config(ModelSource(path=os.path.abspath(path), kind="hf"))
            files = _checkpoint_files(path)
        except Exception as e:
            reason = f"cannot read the checkpoint: {type(e).__name__}: {e}"
    if reason is None:
        # An index may name any path: only files inside the folder count.
        outside = [f for f in files if os.path.relpath(f, path).split(os.sep)[0] == os.pardir]
        if not files:
            reason = "no .safetensors files"
        elif outside or not all(os.path.isfile(f) for f in files):
            reason = "its index names files outside the folder or missing ones"
        else:
            want = getattr(hf_config, "architectures", None), *(getattr(hf_config, k, None)
                                                                for k in _SHAPE_KEYS)
            got = getattr(config, "architectures", None), *(getattr(config, k, None)
                                                            for k in _SHAPE_KEYS)
            if want != got:
                reason = "another architecture (" + "; ".join(
                    f"{k}: {w} != {g}" for k, w, g in zip(("architectures", *_SHAPE_KEYS), want,
                                                          got, strict=True) if w != g) + ")"
    if reason is not None:
        logger.warning("update_weights_from_disk: model_path %r refused: %s", model_path, reason)
        raise _not_loadable(model_path)
    return files


# safetensors' dtype names -> torch's (those torch has); any other is refused as not floating.
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                       "BOOL": "bool"}


def _header_tensors(files: list[str]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint as a meta tensor of its name, shape and dtype, from the
    safetensors headers alone (no tensor data read)."""
    from safetensors import safe_open

    out: list[tuple[str, torch.Tensor]] = []
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                sl = sf.get_slice(name)
                dtype_name = sl.get_dtype()
                dtype = getattr(torch, _SAFETENSORS_DTYPES.get(dtype_name, ""), None)
                if not isinstance(dtype, torch.dtype):
                    raise _HeaderDtypeError(name, dtype_name)
                out.append((name, torch.empty(sl.get_shape(), dtype=dtype, device="meta")))
    return out


class _HeaderDtypeError(Exception):
    """A checkpoint tensor of a dtype torch has no name for (refused like an int tensor)."""

    def __init__(self, name: str, dtype: str) -> None:
        super().__init__(name, dtype)
        self.name, self.dtype = name, dtype


def load_checkpoint(runner: object, files: list[str], model_path: str | None = None) -> int:
    """``collective_rpc`` target: every rank reads the checkpoint itself (no tensors cross
    processes) and stages it as one update (``ModelRunner.stage_weights``: the engine commits or
    rolls back every rank's together). First the headers are checked against the model (names,
    dtypes, shapes: ValueError, nothing read or changed), then the data is read (a read error
    is ValueError naming model_path too, nothing changed), then it loads."""
    from safetensors.torch import load_file

    model = runner.model  # type: ignore[attr-defined]
    where = f"model_path {model_path!r}" if model_path is not None else "the checkpoint"
    try:
        headers = _header_tensors(files)
    except _HeaderDtypeError as e:
        raise ValueError(f"{where}: weight {e.name!r} has dtype {e.dtype}; the model's weights "
                         "take floating-point tensors") from None
    except Exception as e:
        logger.warning("update_weights_from_disk: %s: cannot read the safetensors headers: %s: "
                       "%s", where, type(e).__name__, e)
        raise _not_loadable(str(model_path)) from None
    try:
        plan_update(model, headers)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    weights: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            weights.update(load_file(f))
    except Exception as e:
        logger.warning("update_weights_from_disk: %s: cannot read the tensors: %s: %s", where,
                       type(e).__name__, e)
        raise _not_loadable(str(model_path)) from None
    return runner.stage_weights(list(weights.items()))  # type: ignore[attr-defined]
