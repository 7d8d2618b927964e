"""A small plain-Python model of :mod:`paxcache.allocator` (prefix caching off).

Used two ways:

* by the property tests, as the reference the jitted allocator must agree with (same
  successes and failures, same free counts, same table lengths), so the batched rules below
  mirror the allocator's documented rules exactly: ascending slot order, prefix rule
  ``ok = need == 0 | cumsum(need) <= free`` for :meth:`append` (writers of one shared
  partial block copy while ``ref - earlier writers > 1``), strict
  ``cumsum(need) <= free`` for swaps, all decisions taken on the state at the start of a call,
  blocks released by a call available only after it;
* by ``scripts/bench_allocator.py``, as the per-sequence Python allocator of vLLM v0
  (:meth:`append_one`, one call per sequence).

Block ids may differ from the allocator's: only counts and lengths are compared.
"""

from __future__ import annotations

from collections.abc import Sequence

from paxcache.config import CacheConfig


class ModelAllocator:
    """Per-sequence reference allocator: a free stack, ref counts and Python-list tables."""

    def __init__(self, cfg: CacheConfig) -> None:
        self.cfg = cfg
        self.S = cfg.block_size
        self.M = cfg.max_blocks_per_seq
        self.B = cfg.max_seqs
        self.wm = cfg.watermark_blocks
        self.free_blocks: list[int] = list(range(cfg.num_blocks - 1, -1, -1))
        self.ref = [0] * cfg.num_blocks
        self.host_free: list[int] = list(range(cfg.num_host_blocks - 1, -1, -1))
        self.host_ref = [0] * cfg.num_host_blocks
        self.tables: list[list[int] | None] = [None] * cfg.max_seqs
        self.lens = [0] * cfg.max_seqs
        self.swapped = [False] * cfg.max_seqs

    # -- views --------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.host_free)

    def active(self, slot: int) -> bool:
        return self.tables[slot] is not None

    def num_held(self, slot: int) -> int:
        """Blocks (device or host) the slot references."""
        t = self.tables[slot]
        return 0 if t is None else sum(1 for x in t if x >= 0)

    def table_len(self, slot: int) -> int:
        t = self.tables[slot]
        return 0 if t is None else len(t)

    # -- helpers ------------------------------------------------------------------------

    def _release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free_blocks.append(block)

    def _release_host(self, block: int) -> None:
        self.host_ref[block] -= 1
        if self.host_ref[block] == 0:
            self.host_free.append(block)

    def _blocks(self, n: int) -> int:
        return -(-n // self.S)

    # -- operations ---------------------------------------------------------------------

    def allocate(self, slot: int, num_tokens: int) -> bool:
        if not 0 <= slot < self.B or self.tables[slot] is not None:
            return False
        if not 1 <= num_tokens <= self.M * self.S:
            return False
        need = self._blocks(num_tokens)
        left = len(self.free_blocks) - need
        if left < self.wm or left < 0:
            return False
        table = [self.free_blocks.pop() for _ in range(need)]
        for blk in table:
            self.ref[blk] = 1
        self.tables[slot] = table
        self.lens[slot] = num_tokens
        self.swapped[slot] = False
        return True

    def append_one(self, slot: int, n: int) -> tuple[bool, tuple[int, int] | None]:
        """vLLM-v0-style per-sequence append: returns (ok, copy-on-write pair or None)."""
        table = self.tables[slot]
        if n == 0:
            return True, None
        if table is None or self.swapped[slot] or n < 0:
            return False, None
        length = self.lens[slot]
        if length + n > self.M * self.S:
            return False, None
        new_blocks = self._blocks(length + n) - self._blocks(length)
        last = table[length // self.S] if length % self.S else -1
        cow = last >= 0 and self.ref[last] > 1
        if new_blocks + cow > len(self.free_blocks):
            return False, None
        pair = None
        if cow:
            dst = self.free_blocks.pop()
            self.ref[dst] = 1
            table[length // self.S] = dst
            self.ref[last] -= 1  # > 0: it was shared
            pair = (last, dst)
        for _ in range(new_blocks):
            blk = self.free_blocks.pop()
            self.ref[blk] = 1
            table.append(blk)
        self.lens[slot] = length + n
        self._slide(slot, length)
        return True, pair

    def _slide(self, slot: int, old_len: int) -> None:
        w = self.cfg.sliding_window
        if w is None:
            return
        table = self.tables[slot]
        start = max(old_len - w + 1, 0) // self.S
        for c in range(min(start, len(table))):
            if table[c] >= 0:
                self._release(table[c])
                table[c] = -1

    def append(self, counts: Sequence[int]) -> tuple[list[bool], int]:
        """Batched append with the allocator's rules; returns (ok per slot, number of copies)."""
        free0 = len(self.free_blocks)
        need: list[int] = []
        want: list[bool] = []
        cow: list[bool] = []
        for slot in range(self.B):
            n = counts[slot]
            table = self.tables[slot]
            length = self.lens[slot]
            w = (
                table is not None
                and not self.swapped[slot]
                and n > 0
                and length + n <= self.M * self.S
            )
            c = False
            nb = 0
            if w:
                nb = self._blocks(length + n) - self._blocks(length)
                last = table[length // self.S] if length % self.S else -1
                c = last >= 0 and self.ref[last] > 1
            want.append(w)
            cow.append(c)
            need.append(nb + c)
        # Writers of one shared partial block, in slot order: copy while ref - rank > 1.
        seen: dict[int, int] = {}
        for slot in range(self.B):
            if cow[slot]:
                table = self.tables[slot]
                last = table[self.lens[slot] // self.S]
                rank = seen.get(last, 0)
                seen[last] = rank + 1
                if self.ref[last] - rank <= 1:
                    cow[slot] = False
                    need[slot] -= 1
        csum = 0
        granted = []
        for slot in range(self.B):
            csum += need[slot]
            granted.append(want[slot] and (need[slot] == 0 or csum <= free0))
        ok = [counts[s] == 0 or granted[s] for s in range(self.B)]
        # Allocate for every granted slot first, release afterwards.
        to_release: list[int] = []
        for slot in range(self.B):
            if not granted[slot]:
                continue
            table = self.tables[slot]
            length = self.lens[slot]
            if cow[slot]:
                col = length // self.S
                dst = self.free_blocks.pop()
                self.ref[dst] = 1
                to_release.append(table[col])
                table[col] = dst
            for _ in range(need[slot] - cow[slot]):
                blk = self.free_blocks.pop()
                self.ref[blk] = 1
                table.append(blk)
            self.lens[slot] = length + counts[slot]
        for blk in to_release:
            self._release(blk)
        for slot in range(self.B):
            if granted[slot]:
                self._slide(slot, self.lens[slot] - counts[slot])
        return ok, sum(cow[s] and granted[s] for s in range(self.B))

    def fork(self, parent: int, child: int) -> bool:
        if not (0 <= parent < self.B and 0 <= child < self.B) or parent == child:
            return False
        if self.tables[parent] is None or self.swapped[parent] or self.tables[child] is not None:
            return False
        table = list(self.tables[parent])
        for blk in table:
            if blk >= 0:
                self.ref[blk] += 1
        self.tables[child] = table
        self.lens[child] = self.lens[parent]
        self.swapped[child] = False
        return True

    def free(self, mask: Sequence[bool]) -> None:
        for slot in range(self.B):
            table = self.tables[slot]
            if not mask[slot] or table is None:
                continue
            for blk in table:
                if blk >= 0:
                    (self._release_host if self.swapped[slot] else self._release)(blk)
            self.tables[slot] = None
            self.lens[slot] = 0
            self.swapped[slot] = False

    def _swap(self, mask: Sequence[bool], out: bool) -> tuple[list[bool], int]:
        src_free = self.host_free if out else self.free_blocks
        if out:
            avail = len(self.host_free) if self.cfg.num_host_blocks else -1
        else:
            avail = len(self.free_blocks) - self.wm if self.cfg.num_host_blocks else -1
        seen: set[int] = set()
        csum = 0
        ok = [False] * self.B
        for slot in range(self.B):
            table = self.tables[slot]
            if not mask[slot] or table is None or self.swapped[slot] == out:
                continue
            fresh = {blk for blk in table if blk >= 0 and blk not in seen}
            seen |= fresh
            csum += len(fresh)
            ok[slot] = csum <= avail
        mapping: dict[int, int] = {}
        for slot in range(self.B):
            if not ok[slot]:
                continue
            table = self.tables[slot]
            for c, blk in enumerate(table):
                if blk < 0:
                    continue
                if blk not in mapping:
                    mapping[blk] = src_free.pop()
                new = mapping[blk]
                if out:
                    self.host_ref[new] += 1
                    self._release(blk)
                else:
                    self.ref[new] += 1
                    self._release_host(blk)
                table[c] = new
            self.swapped[slot] = out
        return ok, len(mapping)

    def swap_out(self, mask: Sequence[bool]) -> tuple[list[bool], int]:
        return self._swap(mask, out=True)

    def swap_in(self, mask: Sequence[bool]) -> tuple[list[bool], int]:
        return self._swap(mask, out=False)
