"""CPU tensors on transparent huge pages, for the weights the linear kernels stream.

A decode step reads every weight once, front to back. On 4 KiB pages the hardware prefetchers
stop at every page boundary and the TLB misses every 64 cache lines, so one stream reads at
about 55-60% of the memory's speed (a 2-core AMD Zen 4: 16 GB/s per core on 4 KiB pages, 30 on
2 MiB ones; docs/performance.md). torch asks for huge pages only under THP_MEM_ALLOC_ENABLE=1,
for every allocation of the process; here only the tensors that ask get them: a fresh anonymous
mapping, its start 2 MiB aligned, advised MADV_HUGEPAGE before anything touches it, so its
pages fault in as huge pages wherever the system grants them (transparent_hugepage ``always``
or ``madvise``; with ``never``, or where a 2 MiB page is not free, 4 KiB pages as before).

Weights under 2 MiB each (a small model's projections: 0.6-1.8 MiB in SmolLM2-135M) would
still land on 4 KiB pages one by one, so ``huge_page_slots`` puts a model's kernel weights
side by side in one mapping, in the order a step reads them: one stream over the whole model.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE_BYTES = 2 * 1024 * 1024


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on memory advised for 2 MiB pages; tensors under
    one huge page, and systems without the advice, get plain ``torch.empty``. The tensor owns
    its mapping (unmapped when the tensor is freed); its contents are undefined, as empty's."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE_BYTES or advice is None:
        return torch.empty(shape, dtype=dtype)
    # One huge page more than needed, to start on a 2 MiB boundary; the unused head and tail
    # are never touched and cost no memory. Private: a shared anonymous mapping is shmem,
    # which has its own huge-page setting (off by default).
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)
    base = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % HUGE_PAGE_BYTES
    try:
        region.madvise(advice, offset, nbytes)
    except OSError:
        pass  # a kernel without transparent huge pages: 4 KiB pages, as torch.empty
    return torch.frombuffer(region, dtype=dtype, count=numel, offset=offset).view(shape)


# Slots are padded to whole 4 KiB pages (on 2 MiB pages each starts page aligned: any
# alignment a kernel's loads assume).
SLOT_ALIGN_BYTES = 4096


def huge_page_slots(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Empty tensors of these (shape, dtype), side by side in this order in one mapping on 2 MiB
    pages (``empty_on_huge_pages``), which is unmapped when the last of them is freed. A caller
    copies each weight into its slot and drops the old tensor before the next, so moving a model
    needs no second copy of it: pages are taken as the copies first touch them."""
    starts, end = [], 0
    for shape, dtype in specs:
        starts.append(end)
        end += -(-math.prod(shape) * dtype.itemsize // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
    region = empty_on_huge_pages((end,), torch.uint8)
    return [region[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for start, (shape, dtype) in zip(starts, specs, strict=True)]
