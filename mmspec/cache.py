"""Static KV cache with per-row lengths: chain rollback and tree-path compaction, batched, no host sync.

Layout per layer: k, v [B, H, T, D], preallocated for T = capacity. `lengths` [B] counts each row's committed
entries; everything at or beyond a row's length is stale and invisible (masks are built from `lengths`).

One verify step writes S new entries per row at slots `lengths + [0, S)` (`slots(S)`), attends through
`attention_mask(slots, tree_mask)`, and then commits:
- chain: `commit_chain(n)` keeps the first n new entries (the last token plus the accepted drafts) in place:
  rolling back the rejected tail is just not advancing `lengths` over it;
- tree: `commit_path(path, n)` copies the entries of the accepted root-to-node path (node indices, root first)
  to the front of the new region, then advances `lengths` by n.
Rows that are finished commit 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mmspec.errors import check, check_positive_int


class StaticKVCache:
    """Preallocated keys and values for `num_layers` layers of a batch of `batch_size` rows."""

    def __init__(self, num_layers: int, batch_size: int, num_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size), ("num_heads", num_heads),
                            ("capacity", capacity), ("head_dim", head_dim)):
            check_positive_int(name, value)
        shape = (batch_size, num_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        self.capacity = capacity
        self.key_limit: int | None = None  # attend over slots [0, key_limit) only (`keys_up_to`); None = all

    @property
    def num_keys(self) -> int:
        """Key slots a step attends over: `key_limit` inside `keys_up_to`, else the capacity."""
        return self.capacity if self.key_limit is None else self.key_limit

    @contextmanager
    def keys_up_to(self, limit: int) -> Iterator[None]:
        """Within the block, `write` returns and `attention_mask` covers only slots [0, limit): a step whose new
        entries all lie below `limit` attends over what it can see instead of the whole capacity (a host-side
        bound, e.g. the step's largest slot + 1; on a CPU the saved work is the attention over empty slots)."""
        check(0 < limit <= self.capacity, f"key limit {limit} outside (0, {self.capacity}].")
        self.key_limit = limit
        try:
            yield
        finally:
            self.key_limit = None

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # ------------------------------------------------------------------------------------------- writing
    def slots(self, num_new: int) -> torch.Tensor:
        """[B, S] cache slots for S new entries per row: lengths + [0, S)."""
        return self.lengths.unsqueeze(-1) + torch.arange(num_new, device=self.device)

    def check_room(self, num_new: int) -> None:
        """Raise if some row cannot take `num_new` more entries (one host sync; call at boundaries)."""
        longest = int(self.lengths.max())
        check(longest + num_new <= self.capacity,
              f"KV cache full: a row holds {longest} entries, {num_new} more requested, capacity "
              f"{self.capacity}. Create the cache with a larger capacity (prompt + max_new_tokens + draft length).")

    def write(self, layer: int, slots: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k_new, v_new [B, H, S, D] at slots [B, S]; return the layer's k, v [B, H, T, D] (T = num_keys).

        Slots shared by every row (one row, or a row expanded: stride 0) are written with one `index_copy_` along
        the slot axis, the same entries as the scatter, which on a CPU costs 3x as much for a 16-token window."""
        k_new, v_new = k_new.to(self.k[layer].dtype), v_new.to(self.v[layer].dtype)
        if slots.shape[-1] > 1 and (slots.shape[0] == 1 or slots.stride(0) == 0):
            self.k[layer].index_copy_(2, slots[0], k_new)
            self.v[layer].index_copy_(2, slots[0], v_new)
        else:
            index = slots[:, None, :, None].expand_as(k_new)  # [B, H, S, D]
            self.k[layer].scatter_(2, index, k_new)
            self.v[layer].scatter_(2, index, v_new)
        t = self.num_keys
        return self.k[layer][:, :, :t], self.v[layer][:, :, :t]

    def attention_mask(self, slots: torch.Tensor, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S, T] bool for queries at `slots` [B, S] (the S new entries of this step).

        Without a tree mask the new entries are causal among themselves; with tree_mask [B, S, S] query i sees
        new entry j iff tree_mask[:, i, j]. Every query sees the committed prefix [0, lengths).
        """
        keys = torch.arange(self.num_keys, device=self.device)  # [T]
        prefix = keys < self.lengths[:, None, None]  # [B, 1, T]
        if tree_mask is None:  # the prefix, and the new entries up to the query's own (slots >= lengths)
            return prefix | (keys <= slots.unsqueeze(-1))
        offset = keys - self.lengths.unsqueeze(-1)  # [B, T] key offset inside the new region
        in_new = (offset >= 0) & (offset < slots.shape[1])  # [B, T]
        s = slots.shape[1]
        tree_cols = tree_mask.gather(2, offset.clamp(0, s - 1).unsqueeze(1).expand(-1, s, -1))  # [B, S, T]
        return prefix | (in_new.unsqueeze(1) & tree_cols)

    # ------------------------------------------------------------------------------------------ commits
    def commit_chain(self, num_kept: torch.Tensor) -> None:
        """Keep the first num_kept [B] entries of the last write (they are already in place)."""
        self.lengths = self.lengths + num_kept

    def commit_path(self, path: torch.Tensor, num_kept: torch.Tensor) -> None:
        """Compact a tree step: path [B, P] node offsets inside the new region (root first, -1 padded); the
        first num_kept [B] of them move to offsets 0..num_kept-1. Node offsets increase along a path, so
        reading every source before writing is safe."""
        p = path.shape[1]
        dst = self.lengths.unsqueeze(-1) + torch.arange(p, device=self.device)  # [B, P]
        src = self.lengths.unsqueeze(-1) + path.clamp_min(0)  # [B, P]
        keep = torch.arange(p, device=self.device) < num_kept.unsqueeze(-1)  # [B, P]
        # dst < lengths + P <= capacity: the verify step wrote at least P entries there
        for buf in self.k + self.v:
            h, d = buf.shape[1], buf.shape[3]
            src_idx = src[:, None, :, None].expand(-1, h, -1, d)  # [B, H, P, D]
            dst_idx = dst[:, None, :, None].expand(-1, h, -1, d)
            moved = torch.where(keep[:, None, :, None], buf.gather(2, src_idx), buf.gather(2, dst_idx))
            buf.scatter_(2, dst_idx, moved)
        self.lengths = self.lengths + num_kept

    def grow(self, capacity: int) -> None:
        """Room for `capacity` slots per row (no-op if it has them): new zeroed buffers holding the old entries.
        Entries, lengths and slots stay where they were; only the room after them grows."""
        if capacity <= self.capacity:
            return
        for buffers in (self.k, self.v):
            for i, old in enumerate(buffers):
                new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])  # [B, H, T', D]
                new[:, :, : self.capacity] = old
                buffers[i] = new
        self.capacity = capacity

    def reset(self) -> None:
        self.lengths = torch.zeros_like(self.lengths)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` [B'] (e.g. to drop finished rows); index order defines the new batch."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]
        self.lengths = self.lengths.index_select(0, rows)
