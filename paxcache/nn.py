"""Flax NNX layers on the paged KV cache.

:class:`PagedAttention` is the one call a Flax model swaps in for its attention: given the
step's projected ``q, k, v`` and the model's KV cache, it writes the new keys and values into
the pages and attends over each sequence's whole context (ragged batch: prefill, decode,
chunked prefill and prefix hits together). It holds no parameters; the cache is passed in and
returned, so it stays a pure value the caller can donate across steps.

The layer is built with what belongs to the model (heads, head dim, scale, soft cap, sliding
window). How it runs (kernel implementation, interpret mode, the tensor-parallel mesh) comes
with the step's :class:`~paxcache.attention.AttentionMetadata`, so the engine's choices reach
every layer of any model that uses it, the bundled Llama included, with no change to the model.

Shape letters: T token rows, H query heads, K kv heads, D head dim, N blocks, S block size.
"""

from __future__ import annotations

import jax
from flax import nnx

import kernels_pallas as kp
from paxcache.attention import AttentionMetadata, paged_attention_op

__all__ = ["PagedAttention"]


class PagedAttention(nnx.Module):
    """Paged, ragged, causal attention over a block-table KV cache.

    Args:
      num_heads: H, query heads.
      num_kv_heads: K, key/value heads (``H % K == 0``; GQA when ``H > K``).
      head_dim: D.
      sm_scale: logit scale, default ``D ** -0.5``.
      soft_cap: optional logit soft cap.
      sliding_window: optional window (a query at ``p`` sees keys in ``(p - window, p]``).
      impl: pin a kernel choice of :mod:`kernels_pallas`; None (default) follows the
        metadata's ``impl`` (the engine's).
      interpret: pin Pallas interpret mode; None follows the metadata.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        sm_scale: float | None = None,
        soft_cap: float | None = None,
        sliding_window: int | None = None,
        impl: str | None = None,
        interpret: bool | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sm_scale = sm_scale
        self.soft_cap = soft_cap
        self.sliding_window = sliding_window
        self.impl = impl
        self.interpret = interpret

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        kv_cache: kp.PagedKVCache,
        metadata: AttentionMetadata,
        *,
        layer: int | jax.Array | None = None,
        sinks: jax.Array | None = None,
    ) -> tuple[jax.Array, kp.PagedKVCache]:
        """Attend and update the cache.

        Args:
          q: ``[T, H, D]``; k, v: ``[T, K, D]`` (rotary embeddings already applied).
          kv_cache: the model's :class:`kernels_pallas.PagedKVCache` (all layers; from
            ``kp.init_kv_cache``).
          metadata: the step's :class:`~paxcache.attention.AttentionMetadata` (also says how
            the op runs: ``impl``, ``interpret``, ``mesh``).
          layer: the layer (int, or a traced scalar inside ``lax.scan``; optional for a
            one-layer cache).
          sinks: optional ``f32[H]`` attention sinks of this layer (gpt-oss: a learned logit
            per query head in the softmax denominator; the XLA path runs them).

        Returns:
          ``(out [T, H, D], kv_cache)`` with this step's K/V written.
        """
        return paged_attention_op(
            q,
            k,
            v,
            kv_cache,
            metadata,
            layer=layer,
            sm_scale=self.sm_scale,
            soft_cap=self.soft_cap,
            sliding_window=self.sliding_window,
            impl=self.impl,
            interpret=self.interpret,
            sinks=sinks,
        )
