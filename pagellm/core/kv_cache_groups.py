"""KV cache groups: layers that share block tables, for models that mix full and sliding-window
attention (pure Python; vLLM's hybrid allocator in small).

Layers are grouped by attention type (full, or sliding with window W). All layers of one type
need the same blocks at the same time, so they share one block table; a windowed group frees the
blocks that fell out of every window of a request while the full group keeps growing.

Memory: all groups draw from one block pool. With several groups, every type's layers are cut
into groups of ``group_size`` layers (the smallest type's layer count), and the cache holds
``group_size`` K/V tensors; layer ``j`` of every group lives in tensor ``j``. A block id thus
names ``group_size`` layers' worth of KV, whichever group holds it. Gemma-2 (13 sliding + 13
global layers): two groups of 13, so a long request holds its full length in one group and only
its window in the other, about half the KV of keeping every layer's full length. A type whose
layer count is not a multiple of ``group_size`` leaves its last group short (some tensor slots
of that group's blocks unused), as vLLM does.

A model whose layers are all of one type has a single group (the original layout: one tensor
per layer, one block table); a windowed one still frees blocks behind its window.

Recurrent layers (Gated DeltaNet, Mamba-2: ``state_layers``) keep no per-token KV: each request
holds one fixed-size *state slot* per step instead (the conv window and the recurrent state of
every such layer, worker/state_cache.py), from a pool of slots the KV cache manager hands out
beside the blocks (core/state_slots.py). They form the layout's state group; the attention
layers alone make the block groups above, and ``tensor_of_layer`` is -1 for a state layer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # model layer indices
    sliding_window: int | None  # None: full attention


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    # K/V tensors the cache allocates (each [blocks, block_size, kv_heads, head_dim]).
    num_tensors: int
    # Per model layer: its group and the tensor its K/V live in.
    group_of_layer: tuple[int, ...]
    tensor_of_layer: tuple[int, ...]
    # Model layers with recurrent state instead of KV (group and tensor -1 above).
    state_layers: tuple[int, ...] = ()

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> list[int | None]:
        return [g.sliding_window for g in self.groups]

    def blocks_for_tokens(self, num_tokens: int, block_size: int,
                          extra_tokens: int = 0) -> int:
        """Blocks one request of ``num_tokens`` tokens holds at most, all groups together:
        a full group holds them all, a windowed one its window plus ``extra_tokens`` (the tokens
        of one step's chunk) and one partial block."""
        total = 0
        for group in self.groups:
            full = -(-num_tokens // block_size)
            if group.sliding_window is None:
                total += full
            else:
                span = group.sliding_window - 1 + max(extra_tokens, 1)
                total += min(full, -(-span // block_size) + 1)
        return total


def kv_cache_layout(layer_windows: list[int | None],
                    state_layers: tuple[int, ...] = ()) -> KVCacheLayout:
    """The groups of layers with these sliding windows (None: full attention), in first-layer
    order; a single group (one tensor per attention layer) when every attention layer is of one
    type. ``state_layers``: layers with recurrent state instead (their window is ignored)."""
    n = len(layer_windows)
    state = tuple(sorted(set(state_layers)))
    attention = [i for i in range(n) if i not in state]
    if not attention:
        raise ValueError("a model needs at least one attention layer")
    types: dict[int | None, list[int]] = {}
    for i in attention:
        types.setdefault(layer_windows[i], []).append(i)
    group_of = [-1] * n
    tensor_of = [-1] * n
    if len(types) == 1:
        window = layer_windows[attention[0]]
        for slot, layer in enumerate(attention):
            group_of[layer], tensor_of[layer] = 0, slot
        return KVCacheLayout((KVCacheGroup(tuple(attention), window),), len(attention),
                             tuple(group_of), tuple(tensor_of), state)
    group_size = min(len(layers) for layers in types.values())
    groups: list[KVCacheGroup] = []
    for window, layers in types.items():
        for start in range(0, len(layers), group_size):
            members = tuple(layers[start:start + group_size])
            for slot, layer in enumerate(members):
                group_of[layer] = len(groups)
                tensor_of[layer] = slot
            groups.append(KVCacheGroup(members, window))
    return KVCacheLayout(tuple(groups), group_size, tuple(group_of), tuple(tensor_of), state)


def num_skipped_blocks(num_computed_tokens: int, sliding_window: int | None,
                       block_size: int) -> int:
    """Leading blocks of a request no query from ``num_computed_tokens`` on can see: the next
    query, at position ``num_computed_tokens``, sees keys from ``num_computed_tokens - W + 1``."""
    if sliding_window is None:
        return 0
    return max(num_computed_tokens - sliding_window + 1, 0) // block_size
