"""A step's inputs in one host-to-device transfer.

:class:`~paxcache.step.StepInputs` is a pytree of ~17 small arrays (tokens, rows, lengths,
sampling parameters and keys; a multi-step decode's keys, stop ids and token limits). Placed
leaf by leaf, each one is a transfer of its own, and each is a leaf the jitted call checks:
on XLA:CPU at 256 rows, 17 placements took 350-690 µs and the call with them ~130 µs, against
~60 µs and ~30 µs for one packed buffer (``scripts/bench_host.py`` measures the engine
around it). :func:`pack` lays every leaf but two into one ``i32`` vector (32-bit values as
their bits, booleans as 0/1) with a static :class:`Layout`; the step program unpacks it
(:meth:`PackedInputs.unpack`: static slices and bitcasts, fused into their consumers).

Two leaves stay apart: ``token_ids``, which a pipelined continuation takes from the device
(:func:`paxcache.overlap.gather_tokens`), and ``allowed``, a constrained step's bitmask
(``R x V/32`` words: megabytes at a large vocabulary, which packing would copy once more).
The layout is a function of the inputs' structure and shapes only, so equal shapes pack
alike whether packed on the host (numpy, :func:`pack` outside a trace) or on the device
(inside a jitted function: :func:`paxcache.decode_loop.next_inputs` returns packed inputs),
and a program compiled for one runs the other.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Layout", "PackedInputs", "pack"]

_APART = ("token_ids", "allowed")  # the leaves that are not packed (module docstring)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each packed leaf sits (static: part of the jitted program's cache key).

    Attributes:
      treedef: the inputs' structure with ``token_ids`` and ``allowed`` set to None.
      leaves: ``(shape, numpy dtype)`` of each packed leaf in ``treedef``'s order; leaf ``i``
        takes the ``prod(shape)`` words after those of the leaves before it.
    """

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], np.dtype], ...]

    @property
    def num_words(self) -> int:
        """Words of the packed vector."""
        return sum(math.prod(shape) for shape, _ in self.leaves)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PackedInputs:
    """A step's inputs as one ``i32`` vector plus the two leaves kept apart.

    Attributes:
      words: ``i32[W]`` the packed leaves (:class:`Layout`).
      token_ids: ``i32[T]`` the fed tokens.
      allowed: ``i32[R, ceil(V/32)]`` the allowed-token bitmask, or None.
      layout: static :class:`Layout`.
    """

    words: Any
    token_ids: Any
    allowed: Any
    layout: Layout

    def tree_flatten(self) -> tuple[tuple[Any, Any, Any], Layout]:
        return (self.words, self.token_ids, self.allowed), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Layout, children: tuple[Any, Any, Any]) -> PackedInputs:
        return cls(*children, layout=layout)

    def unpack(self) -> Any:
        """The :class:`~paxcache.step.StepInputs` these words hold (jax arrays; inside a
        trace, slices of ``words``)."""
        words = jnp.asarray(self.words)
        leaves, start = [], 0
        for shape, dtype in self.layout.leaves:
            size = math.prod(shape)
            word = words[start : start + size].reshape(shape)
            start += size
            if dtype == np.bool_:
                leaves.append(word != 0)
            elif dtype == np.int32:
                leaves.append(word)
            else:
                leaves.append(jax.lax.bitcast_convert_type(word, dtype))
        rest = jax.tree_util.tree_unflatten(self.layout.treedef, leaves)
        return rest.replace(token_ids=self.token_ids, allowed=self.allowed)

    def structure(self) -> Any:
        """The :class:`~paxcache.step.StepInputs` of ``jax.ShapeDtypeStruct`` leaves these
        words hold: their shapes and which optional parts are set, without reading them."""
        leaves = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in self.layout.leaves]
        rest = jax.tree_util.tree_unflatten(self.layout.treedef, leaves)
        token_ids = jax.ShapeDtypeStruct(self.token_ids.shape, self.token_ids.dtype)
        allowed = self.allowed
        if allowed is not None:
            allowed = jax.ShapeDtypeStruct(allowed.shape, allowed.dtype)
        return rest.replace(token_ids=token_ids, allowed=allowed)


def _words(path: Any, leaf: Any, xp: Any) -> Any:
    """``leaf`` as a flat ``i32`` vector of its bits (booleans as 0/1), with ``xp`` numpy on
    the host or ``jax.numpy`` inside a trace."""
    x = xp.asarray(leaf).reshape(-1)
    if x.dtype == np.bool_:
        return x.astype(np.int32)
    if x.dtype.itemsize != 4:
        raise TypeError(f"step input {jax.tree_util.keystr(path)} is {x.dtype}: not 32-bit")
    return x.view(np.int32) if xp is np else jax.lax.bitcast_convert_type(x, jnp.int32)


def pack(inputs: Any) -> PackedInputs:
    """``inputs`` (a :class:`~paxcache.step.StepInputs`) packed: on the host (numpy, one
    ``np.concatenate``) when every packed leaf is a host array, else with jax ops (inside a
    jitted function; eagerly, a few small device ops). ``token_ids`` and ``allowed`` are
    passed through as they are.

    Raises:
      TypeError: a packed leaf is not 32 bits wide (nor boolean).
    """
    rest = inputs.replace(**dict.fromkeys(_APART))
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(rest)
    leaves = [leaf for _, leaf in with_paths]
    layout = Layout(treedef, tuple((np.shape(x), _dtype(x)) for x in leaves))
    xp = jnp if any(isinstance(x, jax.Array) for x in leaves) else np
    words = [_words(p, x, xp) for p, x in with_paths]
    packed = xp.concatenate(words) if words else xp.zeros(0, np.int32)
    return PackedInputs(packed, inputs.token_ids, inputs.allowed, layout)


def _dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
