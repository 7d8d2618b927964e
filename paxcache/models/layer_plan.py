"""Per-layer attention: which static attention each layer runs, and the layer loop over them.

A model whose layers attend differently (Gemma 2/3: sliding and full layers with their own RoPE
bases; Qwen2/3 ``layered`` windows; Mistral-style models with one window everywhere are the
uniform case) describes each layer with a :class:`LayerAttention`: the attention kernel's
static options (``sliding_window``, ``soft_cap``, ``sm_scale``) and which RoPE table the
layer's q/k rotate with. :func:`run_layers` then runs the stacked ``[L, ...]`` layer weights
with every layer's options static, so the one attention call
(:func:`paxcache.attention.paged_attention_op` over ``kernels_pallas.ragged_paged_attention``)
is specialised per layer kind, with no branch at run time.

How the loop is laid out (:func:`layer_segments`): if the kinds repeat with a short period
``p`` (Gemma 2: 2, Gemma 3: 6; uniform models: 1), one ``lax.scan`` runs the ``L // p``
groups, each an unrolled body of ``p`` layers, and the ``L % p`` layers left over (a prefix of
the pattern: Gemma-3-27B's 62 = 10 x 6 + 2) run unrolled after it. When runs of equal kinds
are fewer than those ``p + L % p`` bodies (Qwen2's first ``max_window_layers`` full, the rest
windowed), each run is its own scan instead. Compile time thus grows with the number of
distinct layer bodies traced, never with the depth. The alternative, one scan over all
layers with ``lax.switch`` on a per-layer kind index, compiles every kind once but passes the
whole KV cache through a conditional, where the kernel's in-place cache update is no longer
guaranteed to alias (a copy of the cache per layer); the grouped scan keeps the uniform
model's program unchanged (period 1: the same single scan as before).

Layer weights are read inside the loop with a dynamic index into the stacked arrays (as
``lax.scan`` itself does), never sliced outside it, so no segment copies weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "MAX_PERIOD",
    "LayerAttention",
    "Segment",
    "layer_segments",
    "run_layers",
    "shared_window",
]

MAX_PERIOD = 8
"""Longest repeating pattern of layer kinds unrolled inside one scan body."""


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """One layer's static attention options.

    Attributes:
        sliding_window: a query at ``p`` sees keys in ``(p - window, p]``; None: full causal.
        soft_cap: attention logits become ``cap * tanh(logits / cap)`` (Gemma 2); None: off.
        sm_scale: logit scale; None: ``head_dim ** -0.5``.
        rope: the name of the RoPE table this layer's q/k rotate with (the model's
            ``rope_tables`` keys: ``"default"``, or Gemma 3's ``"sliding_attention"`` /
            ``"full_attention"``).
    """

    sliding_window: int | None = None
    soft_cap: float | None = None
    sm_scale: float | None = None
    rope: str = "default"


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive layers ``start .. start + len(pattern) * repeats - 1``, run as ``repeats``
    groups of ``len(pattern)`` layers with kinds ``pattern`` (a scan when ``repeats > 1``)."""

    start: int
    pattern: tuple[Hashable, ...]
    repeats: int

    @property
    def num_layers(self) -> int:
        """Layers the segment covers."""
        return len(self.pattern) * self.repeats


def layer_segments(kinds: Sequence[Hashable], max_period: int = MAX_PERIOD) -> list[Segment]:
    """How :func:`run_layers` lays out layers of the given kinds (see the module docstring).

    Args:
        kinds: one hashable kind per layer (length L >= 1).
        max_period: longest pattern unrolled in one scan body.

    Returns:
        Segments covering layers ``0 .. L - 1`` in order.

    Raises:
        ValueError: no layers.
    """
    kinds = tuple(kinds)
    n = len(kinds)
    if n == 0:
        raise ValueError("layer_segments needs at least one layer")
    runs, start = [], 0
    for i in range(1, n + 1):
        if i == n or kinds[i] != kinds[start]:
            runs.append(Segment(start, (kinds[start],), i - start))
            start = i
    for p in range(1, min(max_period, n) + 1):
        if all(kinds[i] == kinds[i % p] for i in range(n)):
            # Compile cost = layer bodies traced: p + the tail, against one per run.
            if p + n % p > len(runs):
                break
            segs = [Segment(0, kinds[:p], n // p)]
            if n % p:
                segs.append(Segment(n - n % p, kinds[: n % p], 1))
            return segs
    return runs


def run_layers(
    body: Callable[[Any, dict[str, jax.Array], Any, Hashable], Any],
    carry: Any,
    stacked: dict[str, jax.Array],
    kinds: Sequence[Hashable],
) -> Any:
    """Runs every layer: ``carry = body(carry, layer_params, layer, kind)`` for layers in order.

    Args:
        body: one layer; ``layer_params`` is the layer's slice of ``stacked`` (the ``[L]`` axis
            removed), ``layer`` its index (an int, or a traced i32 scalar inside a scan),
            ``kind`` its entry of ``kinds`` (always static).
        carry: the loop state (e.g. the residual stream and the KV cache).
        stacked: name -> ``[L, ...]`` stacked layer weights.
        kinds: one static kind per layer (length L).

    Returns:
        The final carry.
    """

    def layer_params(layer: Any) -> dict[str, Any]:  # tree-mapped: a quantized weight's leaves
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, False), stacked)

    for seg in layer_segments(kinds):
        p = len(seg.pattern)
        if seg.repeats == 1:
            for j, kind in enumerate(seg.pattern):
                layer = seg.start + j
                carry = body(carry, jax.tree.map(lambda a, i=layer: a[i], stacked), layer, kind)
            continue

        def group(carry: Any, g: jax.Array, seg: Segment = seg, p: int = p) -> tuple[Any, None]:
            for j, kind in enumerate(seg.pattern):
                layer = seg.start + g * p + j
                carry = body(carry, layer_params(layer), layer, kind)
            return carry, None

        carry, _ = jax.lax.scan(group, carry, jnp.arange(seg.repeats, dtype=jnp.int32))
    return carry


def shared_window(windows: Sequence[int | None]) -> int | None:
    """The window the block allocator may free blocks behind, or None.

    The allocator's ``CacheConfig.sliding_window`` frees blocks that fall out of the window,
    so it is set only when EVERY layer uses that one window: a model with a full-attention
    layer (or two window sizes) keeps every block, and each windowed layer's kernel merely
    skips the blocks outside its own window.
    """
    ws = set(windows)
    return ws.pop() if len(ws) == 1 else None
