"""LazyTensor: slicing a checkpoint tensor reads only the slice; any other use reads it whole and
behaves like the plain tensor."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagellm.models import lazy_tensor
from pagellm.models.lazy_tensor import LazyTensor


def test_slices_read_only_their_bytes_and_the_rest_reads_everything(tmp_path) -> None:
    full = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    bias = torch.arange(6, dtype=torch.bfloat16)
    save_file({"w": full, "b": bias}, tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:
        w, b = LazyTensor(f.get_slice("w")), LazyTensor(f.get_slice("b"))
        assert w.shape == (6, 8) and w.dtype == torch.float32 and w.dim() == 2
        assert b.dtype == torch.bfloat16 and b.numel() == 6

        before = lazy_tensor.checkpoint_bytes_read()
        assert torch.equal(w.narrow(0, 2, 3), full.narrow(0, 2, 3))  # column-parallel rows
        assert torch.equal(w.narrow(-1, 4, 4), full[:, 4:8])  # row-parallel columns
        assert torch.equal(w[1:3], full[1:3])
        assert lazy_tensor.checkpoint_bytes_read() - before == (3 * 8 + 6 * 4 + 2 * 8) * 4

        before = lazy_tensor.checkpoint_bytes_read()
        dst = torch.zeros(6, 8)
        dst.copy_(w)  # a replicated weight: through __torch_function__, whole
        assert torch.equal(dst, full)
        assert torch.equal(w[[0, 5]], full[[0, 5]])  # fancy index: whole, then indexed
        assert torch.equal(b.float(), bias.float())  # any tensor method: whole
        assert lazy_tensor.checkpoint_bytes_read() - before == 2 * 6 * 8 * 4 + 6 * 2
