"""Functional paged-KV block allocator: ``BlockState`` plus pure, jit-compiled step functions.

Every function takes a :class:`BlockState` and returns a new one (plus a small result
dataclass). They are pure, static-shaped, batched over sequence slots (no Python loop over
sequences) and never raise inside jit: each reports ``ok`` flags instead, and a refused
operation leaves the state of the refused slot bitwise unchanged (for single-slot operations:
the whole state). They can be ``jax.jit``-ed on their own (the config is static pytree
metadata, so the state is the only array argument) or traced inside a larger jitted function
(the engine fuses :func:`append` into its model step).

Conventions
-----------
* **Block ids.** Every id ``0..N-1`` is a usable block; there is no reserved null block.
  ``-1`` means "no block" in block tables and plans. Consumers (kernels) must never
  dereference a negative id.
* **Tables are position-indexed.** Column ``c`` of ``block_tables[slot]`` holds the block of
  tokens ``[c*S, (c+1)*S)``. With a sliding window, released columns hold ``-1``.
* **Free pool.** A block is *free* iff its ref count is 0 and the prefix cache does not hold
  it. Free blocks live on a stack (``free_stack[:num_free]``). Blocks with ref count 0 that the
  prefix cache still holds are *evictable*: they count as free (``num_free_blocks``) but are
  only taken, least-recently-used first, when the stack runs short (a ``lax.cond`` path, so
  the common path does no O(N log N) work).
* **Serving order.** When blocks run short in a batched call, slots are served in ascending
  slot index with a *prefix rule*: ``ok = need == 0 | cumsum(need) <= available``
  (``cumsum`` in slot order, over the slots that asked for something). Once a slot is refused,
  every later slot that needs a block is refused too, even if it would have fitted.
  :func:`swap_out` / :func:`swap_in` use the strict form ``ok = cumsum(need) <= available``.
  ``available`` is free + evictable blocks for :func:`append` (no watermark, as vLLM's
  append), free + evictable - watermark for :func:`swap_in`, free host blocks for
  :func:`swap_out`; :func:`allocate` needs ``free + evictable - cost >= watermark + reserve``
  (``reserve``: its argument, default 0).
* **Copy-on-write.** In :func:`append`, a slot that writes into its last, partially filled
  block while that block's ref count is > 1 gets a fresh block, its table points to it, the
  shared block's ref count drops by one and ``(src, dst)`` is reported. When several slots
  sharing one partial block append in the same call, they are taken in slot order: slot ``i``
  copies iff ``ref - (writers of that block before i) > 1``, so when every holder writes, the
  last one keeps the block in place (exactly as serving them one by one, vLLM-style). The
  decision is made on the state at the start of the call and does not depend on which slots
  are refused (a refused writer's view below its length is never touched).
* **Sliding window** (``cfg.sliding_window = W``): a query at position ``p`` sees keys in
  ``(p - W, p]``. When :func:`append` grows a sequence from ``L`` tokens, every block wholly
  below position ``L - W + 1`` is released (its table entry set to ``-1``), so a decoding
  sequence never holds more than ``ceil(W / S) + 1`` blocks. :func:`allocate` keeps every
  prompt block (the prompt may be computed in chunks). Blocks released by a call return to
  the pool at the end of that call (they do not fund the same call's allocations).
* **Prefix caching** (``cfg.enable_prefix_caching``). A full block is cached under the key
  ``(parent block id, parent generation, salt, its S token ids)``. ``gen[b]`` is bumped each
  time block ``b`` is evicted, so children of an evicted parent can never be matched again.
  A 32-bit hash of the key (``key_hash``) finds the candidate; the hit is then verified on the
  exact stored tokens, parent, parent generation and salt (never a hash alone). A hit never
  covers the whole prompt: at least one token is left to compute. Identical keys registered
  concurrently may yield duplicate cached blocks; lookups take the lowest id (harmless).
  Counters ``prefix_queries`` / ``prefix_hits`` count *tokens* (prompt tokens looked up /
  prompt tokens found) over successful :func:`allocate` calls. Freed cached blocks stay
  evictable until their space is needed; never-cached free blocks are always used first, then
  evictable ones are evicted oldest ``last_access`` first, deepest block (largest position in
  its sequence) first on ties, then lowest id. A hit on an evictable block revives it.
* **Visibility of not-yet-computed blocks.** ``allocate(..., commit=True)`` (the default)
  makes the prompt's full blocks visible to later lookups at once (vLLM v0: the prompt is
  computed in the same step). With ``commit=False`` they become visible only when
  :func:`commit` is called with ``num_computed`` covering them, so another request never hits
  a block whose KV is not written yet (chunked prefill). :func:`append` with ``token_ids``
  records the new tokens so that blocks filled during decode become cacheable; with
  ``commit=True`` it registers them at once, otherwise :func:`commit` does. Without token ids
  those blocks (and everything after them in that sequence) are simply not cached.
* **Swapping.** The host tier has its own ref counts and free stack. A swapped slot's table
  holds *host* ids while ``swapped[slot]`` is set. A block shared by several slots swapped in
  the same call moves once. Plans are fixed length ``NH`` (padded with ``-1``) plus ``num``.
  A swapped-in sequence's blocks are not prefix-cacheable any more (tokens are not kept on
  the host).
* ``clock`` advances by one on every successful mutating call and stamps ``last_access``.
* **Performance.** The decode path of :func:`append` does O(B) work (no sort, no O(N) pass,
  no serial scan over slots); calls that release blocks (sliding window, copy-on-write) or
  evict add one O(N) pass under a ``lax.cond``. Small fields are packed into a few arrays
  because every pytree leaf costs host dispatch time. See ``scripts/bench_allocator.py``.

Modules
-------
* :mod:`~paxcache.allocator.state`: ``BlockState`` (packed fields as properties), the result
  types, :func:`init`, :func:`num_free_blocks`, :func:`num_free_host_blocks`.
* :mod:`~paxcache.allocator.pool`: ref counts, free stacks, LRU eviction.
* :mod:`~paxcache.allocator.prefix_cache`: keys, lookup, registration, :func:`commit`.
* :mod:`~paxcache.allocator.sequences`: :func:`allocate`, :func:`append`, :func:`fork`,
  :func:`free`, :func:`slot_mapping`.
* :mod:`~paxcache.allocator.swap`: :func:`swap_out`, :func:`swap_in`.
* :mod:`~paxcache.allocator.invariants`: :func:`check_invariants`.

The package depends on JAX and :mod:`paxcache.config` only (ARCHITECTURE.md states the import
rules; ``tests/test_architecture.py`` checks them).

Shape letters: B slots (``max_seqs``), N device blocks, NH host blocks, S block size,
M max blocks per sequence, T tokens.
"""

from paxcache.allocator.invariants import check_invariants
from paxcache.allocator.prefix_cache import commit
from paxcache.allocator.sequences import (
    allocate,
    append,
    append_need,
    can_append,
    fork,
    free,
    slot_mapping,
)
from paxcache.allocator.state import (
    AllocateResult,
    AppendResult,
    BlockState,
    ForkResult,
    SwapPlan,
    init,
    num_free_blocks,
    num_free_host_blocks,
)
from paxcache.allocator.swap import swap_in, swap_out

__all__ = [
    "AllocateResult",
    "AppendResult",
    "BlockState",
    "ForkResult",
    "SwapPlan",
    "allocate",
    "append",
    "append_need",
    "can_append",
    "check_invariants",
    "commit",
    "fork",
    "free",
    "init",
    "num_free_blocks",
    "num_free_host_blocks",
    "slot_mapping",
    "swap_in",
    "swap_out",
]
