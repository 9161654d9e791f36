"""The packed weights' huge-page memory (pagellm/kernels/huge_pages.py): 2 MiB aligned, advised
for transparent huge pages (where the system offers them), holding what linear_pack writes, and
handed back to the system with the tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagellm.kernels import cpu_ops
from pagellm.kernels.huge_pages import (
    HUGE_PAGE_BYTES,
    SLOT_ALIGN_BYTES,
    empty_on_huge_pages,
    huge_page_slots,
)

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_offered() -> bool:
    """Whether the kernel grants advised huge pages (mode ``always`` or ``madvise``)."""
    try:
        return "[never]" not in _THP_MODE.read_text()
    except OSError:
        return False


def _mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps fields of the mapping holding ``address`` (None: unmapped)."""
    fields: dict[str, str] | None = None
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            start, end = (int(v, 16) for v in head[0].split("-"))
            if found is not None:
                break
            fields = {}
            if start <= address < end:
                found = fields
        elif fields is not None and ":" in head[0]:
            fields[head[0].rstrip(":")] = " ".join(head[1:])
    return found


def test_small_tensors_are_plain():
    t = empty_on_huge_pages((16, 1024), torch.bfloat16)
    assert t.shape == (16, 1024) and t.dtype == torch.bfloat16 and t.untyped_storage().resizable()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_large_tensors_are_aligned_advised_and_freed():
    t = empty_on_huge_pages((3, HUGE_PAGE_BYTES // 4 + 5), torch.float32)
    assert t.shape == (3, HUGE_PAGE_BYTES // 4 + 5) and t.dtype == torch.float32
    assert t.is_contiguous() and t.data_ptr() % HUGE_PAGE_BYTES == 0
    t.fill_(1.5)  # writable, every byte of it
    assert t.sum().item() == 1.5 * t.numel()
    mapping = _mapping_of(t.data_ptr())
    assert mapping is not None
    if _thp_offered() and "THPeligible" in mapping:
        assert mapping["THPeligible"] == "1"
    address = t.data_ptr()
    del t
    assert _mapping_of(address) is None  # unmapped with the tensor, not kept by anything


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_slots_side_by_side_in_one_mapping():
    specs = [((24, 576), torch.bfloat16), ((3,), torch.float32), ((1600, 700), torch.bfloat16),
             ((5, 7), torch.float32)]
    slots = huge_page_slots(specs)
    assert [(tuple(s.shape), s.dtype) for s in slots] == specs
    addresses = [s.data_ptr() for s in slots]
    assert all(a % SLOT_ALIGN_BYTES == 0 for a in addresses)
    assert addresses == sorted(addresses)  # in the order asked for
    assert addresses[0] % HUGE_PAGE_BYTES == 0
    # No overlap, and no more than a page of padding between slots.
    for s, nxt in zip(slots[:-1], addresses[1:], strict=True):
        end = s.data_ptr() + s.numel() * s.element_size()
        assert end <= nxt < end + SLOT_ALIGN_BYTES
    mapping = _mapping_of(addresses[0])
    assert mapping is not None
    assert all(_mapping_of(a) == mapping for a in addresses)  # one mapping
    for i, s in enumerate(slots):
        s.fill_(i + 1)
    assert [s.float().mean().item() for s in slots] == [1.0, 2.0, 3.0, 4.0]
    first = addresses[0]
    del s
    slots.pop(0)
    assert _mapping_of(first) is not None  # the others still hold it
    slots.clear()
    assert _mapping_of(first) is None


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_pack_on_huge_pages_matches_float64(dtype):
    """A weight over one huge page: packed into the aligned memory, the one- and two-row
    streaming path and the many-row path give the float64 product."""
    if not cpu_ops.linear_packed_supports(torch.empty(16, 32, dtype=dtype)):
        pytest.skip(f"no packed linear kernel for {dtype} on this CPU")
    g = torch.Generator().manual_seed(0)
    n, k = 1024, HUGE_PAGE_BYTES // 1024 // dtype.itemsize + 64
    w = torch.randn(n, k, generator=g).to(dtype)
    packed = cpu_ops.linear_pack(w)
    assert packed.data_ptr() % HUGE_PAGE_BYTES == 0
    for rows in (1, 2, 9):
        x = torch.randn(rows, k, generator=g).to(dtype)
        out = cpu_ops.linear_packed(x, packed, None).double()
        ref = x.double() @ w.double().T
        scale = (x.double().abs() @ w.double().abs().T).max().item()
        tol = 1e-6 if dtype == torch.float32 else 2 ** -7
        assert ((out - ref).abs() <= scale * tol).all(), rows
