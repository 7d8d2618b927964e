"""Tensor parallelism: a device mesh with a ``tp`` axis and the partition specs of the model
and of the KV cache.

Shape letters: L layers, E hidden size, F intermediate size, H query heads, K kv heads, Kc kv
heads in the cache, D head dim, V vocabulary, N blocks, S block size.

How a step runs on ``tp`` devices (Megatron style, all through JAX's SPMD partitioner; no
hand-written communication):

* **Weights.** q/k/v, gate and up projections are *column*-parallel (their output features,
  i.e. whole heads, are split over ``tp``); o and down projections are *row*-parallel (their
  input features are split), so each layer needs one all-reduce after attention and one after
  the MLP, inserted by XLA. Norms and biases of row-parallel layers are replicated. The
  embedding table is replicated; an untied ``lm_head`` ``[E, V]`` is split over the
  vocabulary when ``tp`` divides ``V`` (logits are then gathered, ``[R, V]`` per step, a few
  KB, never a weight).
* **KV cache.** Pages ``[L, N, S, C, P, D]`` (K and V of ``Kc`` heads side by side, packed
  ``P`` to a word) are split over kv heads on axis C (``P(None, None, None, "tp")``). The
  paged attention op (``paxcache.attention.paged_attention_op(..., mesh=)``) runs the KV
  write and the ragged attention per shard under ``jax.shard_map``: each device writes and
  reads only its own heads, so the cache never moves between devices.
* **Block state.** The allocator's ``BlockState`` and the step metadata are small and
  replicated: every device computes the same block ids, no communication.

KV heads and ``tp`` (the rule, checked by :func:`validate_tp`):

* ``tp`` must divide the query heads ``H``.
* ``K % tp == 0``: each device holds ``K / tp`` kv heads (``Kc = K``).
* ``K < tp`` and ``tp % K == 0``: **kv heads are replicated** to ``Kc = tp`` cache heads, one
  per device, each a copy of the kv head its query heads use. k/v projections stay
  replicated (every device computes all K kv heads, which are few) and each device keeps its
  own copy of its head's pages. The KV memory per device is then that of one kv head, and
  the total is ``tp / K`` times the unsharded cache (the price of no communication).
* anything else (e.g. ``K = 6, tp = 4``) is refused with a ``ValueError``.

Multi-host: the mesh is built from ``jax.devices()``, which after
``jax.distributed.initialize()`` lists every host's devices, so the same code runs on a TPU
pod slice with one process per host. Every process must run the same engine steps with the
same requests (multi-controller SPMD); :func:`broadcast_from_leader` sends process 0's
requests to the others as JSON (never pickle: a follower must not run whatever reaches the
channel), and :func:`place` puts values on devices of other processes.

Expert parallelism (mixture-of-experts models, ``ep > 1``): the mesh is 2-D,
``(ep, tp)`` over ``ep * tp`` devices. Expert weights ``[L, X, E, Fm]`` / ``[L, X, Fm, E]``
are split over experts on ``ep`` and over Fm on ``tp`` (:func:`expert_specs`); everything
else (attention, KV cache, router, dense layers) keeps its ``tp`` split and is replicated over
``ep``. Tokens are therefore on every device after attention (all-gather placement, no
all-to-all): each device runs its own experts' share and one all-reduce over ``ep`` and
``tp`` combines them (:mod:`paxcache.models.moe`). ``ep`` must divide the experts and a
dense model refuses ``ep > 1`` (:func:`validate_ep`).

Loading: ``load_pretrained(..., tp=, ep=)`` / ``Engine.from_pretrained(..., tp=, ep=)`` read
a checkpoint straight into these shards (:mod:`paxcache.models.shards`: each device receives
only its block, read from the memory-mapped safetensors files, on every host only its own
devices'; expert weights by :func:`expert_specs`); :func:`place` then leaves them where they
are. A model built in memory (``Engine(model, tp=)``) is still sharded after it was built, so
it must first fit on one device.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import kernels_pallas as kp

__all__ = [
    "EP_AXIS",
    "MAX_BROADCAST_BYTES",
    "TP_AXIS",
    "BroadcastError",
    "broadcast_from_leader",
    "cache_kv_heads",
    "collectives",
    "decode_message",
    "encode_message",
    "expert_specs",
    "kv_sharding",
    "make_mesh",
    "param_specs",
    "place",
    "quantized_scale_spec",
    "replicated",
    "setup_tensor_parallel",
    "shard_params",
    "validate_ep",
    "validate_tp",
]

logger = logging.getLogger(__name__)

TP_AXIS = "tp"
"""Name of the tensor-parallel mesh axis."""

EP_AXIS = "ep"
"""Name of the expert-parallel mesh axis (present only when ``ep > 1``)."""

MAX_BROADCAST_BYTES = 256 << 20
"""Largest message :func:`broadcast_from_leader` sends or accepts (encoded JSON)."""


class BroadcastError(ValueError):
    """A value cannot be sent (not JSON-serializable, too big) or a received message is not
    valid JSON within :data:`MAX_BROADCAST_BYTES`."""


# Stacked layer weights are [L, in, out]; biases [L, out].
_COLUMN = {"q_proj", "gate_proj", "up_proj"}  # split the output features
_ROW = {"o_proj", "down_proj"}  # split the input features
_KV = {"k_proj", "v_proj"}  # column-parallel when tp divides K, else replicated
_KV_BIAS = {"k_bias", "v_bias"}


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def validate_tp(config: Any, tp: int, num_devices: int | None = None) -> None:
    """Checks that a model can run with tensor-parallel degree ``tp``.

    Args:
      config: the model config (``num_attention_heads``, ``num_key_value_heads``).
      tp: the tensor-parallel degree.
      num_devices: devices available (default ``len(jax.devices())``, every host's).

    Raises:
      ValueError: ``tp`` is not a positive int, exceeds the devices, does not divide the
        query heads, or cannot be matched with the kv heads (neither ``K % tp == 0`` nor
        ``tp % K == 0``).
    """
    if not _is_int(tp) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    tp = int(tp)
    if num_devices is None:
        num_devices = len(jax.devices())
    if tp > num_devices:
        raise ValueError(
            f"tp={tp} exceeds the {num_devices} available {jax.default_backend()} device(s); "
            "on CPU simulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N"
        )
    h, k = int(config.num_attention_heads), int(config.num_key_value_heads)
    if h % tp:
        raise ValueError(f"tp={tp} must divide num_attention_heads={h}")
    if k % tp and tp % k:
        raise ValueError(
            f"tp={tp} and num_key_value_heads={k}: tp must divide the kv heads, or the kv "
            f"heads must divide tp (then each kv head is replicated tp/K times)"
        )


def validate_ep(config: Any, tp: int, ep: int, num_devices: int | None = None) -> None:
    """Checks that a model can run with expert-parallel degree ``ep`` next to ``tp``.

    Raises:
      ValueError: ``ep`` is not a positive int; ``ep > 1`` for a model without experts;
        ``ep`` does not divide ``num_experts``; ``ep * tp`` exceeds the devices.
    """
    if not _is_int(ep) or ep < 1:
        raise ValueError(f"ep must be a positive int, got {ep!r}")
    if ep == 1:
        return
    experts = getattr(config, "num_experts", 0)
    if not experts:
        raise ValueError(
            f"ep={ep} needs a mixture-of-experts model; {config.model_type} has no experts"
        )
    if experts % ep:
        raise ValueError(f"ep={ep} must divide num_experts={experts}")
    if num_devices is None:
        num_devices = len(jax.devices())
    if ep * tp > num_devices:
        raise ValueError(
            f"ep={ep} x tp={tp} = {ep * tp} devices exceeds the {num_devices} available "
            f"{jax.default_backend()} device(s)"
        )


def expert_specs(config: Any, mesh: Mesh) -> dict[str, P]:
    """Partition specs of the stacked expert weights on ``mesh`` (module docstring).

    Returns:
      ``expert_gate`` / ``expert_up`` ``[L, X, E, Fm]`` and ``expert_down`` ``[L, X, Fm, E]``:
      X over ``ep`` (when the mesh has it), Fm over ``tp`` when ``tp`` divides it (else
      replicated over ``tp``).
    """
    ep, tp = int(mesh.shape.get(EP_AXIS, 1)), int(mesh.shape.get(TP_AXIS, 1))
    return _expert_specs(config, tp, ep)


def _expert_specs(config: Any, tp: int, ep: int) -> dict[str, P]:
    ex = EP_AXIS if ep > 1 else None
    fm = int(config.moe_intermediate_size)
    ft = TP_AXIS if tp > 1 and fm % tp == 0 else None
    return {
        "expert_gate": P(None, ex, None, ft),
        "expert_up": P(None, ex, None, ft),
        "expert_down": P(None, ex, ft, None),
    }


def cache_kv_heads(num_kv_heads: int, tp: int) -> int:
    """Kc, the kv heads the paged cache holds: ``K``, or ``tp`` when kv heads are replicated.

    Assumes :func:`validate_tp` passed (``K % tp == 0`` or ``tp % K == 0``).
    """
    return max(int(num_kv_heads), int(tp))


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None, ep: int = 1) -> Mesh:
    """A 1-D mesh with axis ``"tp"`` over the first ``tp`` devices (every host's), or with
    ``ep > 1`` a 2-D ``("ep", "tp")`` mesh over the first ``ep * tp``.

    Args:
      tp: tensor-parallel devices.
      devices: the devices to choose from (default ``jax.devices()``).
      ep: expert-parallel groups.

    Raises:
      ValueError: ``tp`` or ``ep`` is not a positive int, or ``ep * tp`` exceeds the devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, v in (("tp", tp), ("ep", ep)):
        if not _is_int(v) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if tp * ep > len(devices):
        raise ValueError(f"ep={ep} x tp={tp} exceeds the {len(devices)} available device(s)")
    if ep == 1:
        return Mesh(np.asarray(devices[:tp]), (TP_AXIS,))
    return Mesh(np.asarray(devices[: ep * tp]).reshape(ep, tp), (EP_AXIS, TP_AXIS))


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of the KV cache's pages: split over kv heads, as the kernels' layout says
    (:func:`kernels_pallas.kv_cache_specs`; its scales are replicated)."""
    return NamedSharding(mesh, kp.kv_cache_specs(TP_AXIS).kv)


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated sharding on ``mesh`` (block state, metadata, small params)."""
    return NamedSharding(mesh, P())


def _leaf_name(path: tuple) -> str:
    """The parameter's attribute name in an ``nnx.State`` path (skipping ``.value``)."""
    names = []
    for entry in path:
        key = getattr(entry, "key", None)
        if key is None:
            key = getattr(entry, "name", None)
        if key is None:
            key = getattr(entry, "idx", None)
        names.append(str(key))
    while names and names[-1] in ("value", "raw_value", "qvalue"):  # qvalue: quantized weight
        names.pop()
    return names[-1] if names else ""


def _spec_for(name: str, shape: tuple[int, ...], config: Any, tp: int, ep: int = 1) -> P:
    """Partition spec of one parameter (Megatron style), replicated when it cannot split."""
    ndim = len(shape)
    if name in ("expert_gate", "expert_up", "expert_down") and ndim == 4:
        return _expert_specs(config, tp, ep)[name]

    def split(axis: int) -> P:
        if shape[axis] % tp:
            logger.warning(
                "tp=%d does not divide %s dim %d (%d); replicating it", tp, name, axis, shape[axis]
            )
            return P()
        spec: list[Any] = [None] * ndim
        spec[axis] = TP_AXIS
        return P(*spec)

    kv_split = int(config.num_key_value_heads) % tp == 0
    if name in _COLUMN and ndim == 3:
        return split(2)
    if name in _ROW and ndim == 3:
        return split(1)
    if name in _KV and ndim == 3:
        return split(2) if kv_split else P()
    if name == "q_bias" and ndim == 2:
        return split(1)
    if name in _KV_BIAS and ndim == 2:
        return split(1) if kv_split else P()
    if name == "lm_head" and ndim == 2 and shape[1] % tp == 0:
        return P(None, TP_AXIS)
    # embed_tokens, norms, o_bias, anything unknown: replicated.
    return P()


def quantized_scale_spec(weight: str, shape: tuple[int, ...], config: Any, tp: int) -> P:
    """Partition spec of a quantized weight's per-output-channel scale ``[L, 1, out]``: split
    over the output axis as the weight's values ``[L, in, out]`` are (column-parallel), else
    replicated (a row-parallel weight's shards all use every output channel's scale).

    Args:
      weight: the weight's attribute name (``q_proj``, ``o_proj`` ...).
      shape: the scale's shape ``[L, 1, out]``.
      config: the model config (``num_key_value_heads``).
      tp: the tensor-parallel degree.
    """
    if weight in _ROW or len(shape) != 3:
        return P()
    return _spec_for(weight, shape, config, tp)


def param_specs(params: Any, config: Any, tp: int, ep: int = 1) -> Any:
    """The ``PartitionSpec`` of every parameter of an ``nnx.split`` state (same pytree).

    Args:
      params: the model's state (e.g. ``nnx.split(model)[1]``); leaves are arrays whose
        path ends in the attribute name (``q_proj``, ``o_proj``, ``lm_head`` ...).
      config: the model config (``num_key_value_heads``).
      tp: the tensor-parallel degree.
      ep: the expert-parallel degree (expert weights, :func:`expert_specs`).
    """

    def spec(path: tuple, leaf: Any) -> P:
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape:
            return P()
        name = _leaf_name(path)
        if name in ("scale", "act_scale"):  # a quantized weight's scales: split like its output
            weight = _leaf_name(path[:-1])
            return quantized_scale_spec(weight, shape, config, tp) if name == "scale" else P()
        return _spec_for(name, shape, config, tp, ep)

    return jax.tree_util.tree_map_with_path(spec, params)


def place(tree: Any, shardings: Any) -> Any:
    """``jax.device_put`` that also works across hosts.

    A leaf already placed as asked (e.g. loaded into its shards) is returned as it is.
    Otherwise, with one process this is ``jax.device_put``. When a sharding spans
    devices of other processes (multi-host, after ``jax.distributed.initialize()``), each
    process builds its own shards from its (identical) host copy of the value with
    ``jax.make_array_from_callback``, so every host must call this with the same ``tree``.

    Args:
      tree: a pytree of arrays.
      shardings: one ``Sharding`` for every leaf, or a pytree of them matching ``tree``.
    """
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def put(x: Any, s: jax.sharding.Sharding) -> jax.Array:
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim):
            return x  # already there (loaded into its shards): no copy, no host round trip
        if jax.process_count() == 1 or s.is_fully_addressable:
            return jax.device_put(x, s)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

    return jax.tree.map(put, tree, shardings)


def shard_params(params: Any, mesh: Mesh, config: Any) -> Any:
    """Places ``params`` on ``mesh`` with :func:`param_specs` (see :func:`place`)."""
    tp, ep = mesh.shape[TP_AXIS], mesh.shape.get(EP_AXIS, 1)
    specs = param_specs(params, config, tp, ep)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    return place(params, shardings)


def setup_tensor_parallel(model: Any, params: Any, tp: int, ep: int = 1) -> tuple[Mesh, Any]:
    """Validates ``tp`` and ``ep``, builds the mesh and shards the model's parameters over it.

    Args:
      model: the NNX model (``model.config`` gives the head and expert counts).
      params: its state from ``nnx.split(model)``.
      tp: tensor-parallel degree.
      ep: expert-parallel degree (mixture-of-experts models only).

    Returns:
      ``(mesh, sharded params)``.

    Raises:
      ValueError: see :func:`validate_tp`, :func:`validate_ep`.
    """
    cfg = model.config
    validate_tp(cfg, tp)
    validate_ep(cfg, tp, ep)
    mesh = make_mesh(tp, ep=ep)
    sharded = shard_params(params, mesh, cfg)
    k = int(cfg.num_key_value_heads)
    if k < tp:
        logger.info("tp=%d > %d kv heads: each kv head is replicated %d times", tp, k, tp // k)
    per_dev = sum(
        math.prod(s.data.shape) * s.data.dtype.itemsize
        for x in jax.tree.leaves(sharded)
        for s in x.addressable_shards[:1]
    )
    logger.info("tensor parallel over %s: %.1f MiB of weights per device", mesh, per_dev / 2**20)
    return mesh, sharded


_COLLECTIVE_RE = re.compile(
    r"=\s*\(?(?P<types>[^=]*?)\)?\s+(?P<op>all-gather|all-gather-start|all-to-all|all-reduce|"
    r"all-reduce-start|collective-permute|collective-permute-start|reduce-scatter)\("
)
_SHAPE_RE = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")


def encode_message(obj: Any) -> bytes:
    """``obj`` as compact JSON bytes (no NaN/inf), at most :data:`MAX_BROADCAST_BYTES`.

    Raises:
      BroadcastError: ``obj`` holds something JSON cannot carry, or is too big.
    """
    try:
        data = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as e:
        raise BroadcastError(f"cannot broadcast {type(obj).__name__}: {e}") from None
    if len(data) > MAX_BROADCAST_BYTES:
        raise BroadcastError(f"message of {len(data)} bytes exceeds {MAX_BROADCAST_BYTES}")
    return data


def decode_message(data: bytes) -> Any:
    """Parses bytes from :func:`encode_message`; never evaluates anything (plain JSON).

    Raises:
      BroadcastError: too big, not UTF-8 or not JSON.
    """
    if len(data) > MAX_BROADCAST_BYTES:
        raise BroadcastError(f"message of {len(data)} bytes exceeds {MAX_BROADCAST_BYTES}")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise BroadcastError(f"received message is not valid JSON: {e}") from None


def broadcast_from_leader(obj: Any) -> Any:
    """Returns process 0's ``obj`` on every process (identity with one process).

    Multi-controller JAX runs the same jitted steps on every host in the same order, so a
    multi-host server must feed every host's engine the same requests: process 0 (the one
    serving HTTP) calls this each round with what it received, the others with anything
    (e.g. ``None``), and all of them then add the result and call ``engine.step()``. The
    engine's scheduling is deterministic, so the hosts stay in lockstep.

    The value travels as JSON (:func:`encode_message`), never pickle, so receiving a message
    cannot run code; the receiver still validates what it got against its own schema (the
    server's rounds: ``paxcache.multihost.EngineRound``).

    Args:
      obj: a JSON-serializable value (only process 0's is used); tuples arrive as lists.

    Raises:
      BroadcastError: on process 0, ``obj`` cannot be encoded; elsewhere, the received bytes
        are not valid JSON.
    """
    if jax.process_count() == 1:
        return obj
    from jax.experimental import multihost_utils

    leader = jax.process_index() == 0
    payload = np.frombuffer(encode_message(obj), np.uint8) if leader else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(payload.size)))
    if not 0 <= n <= MAX_BROADCAST_BYTES:
        raise BroadcastError(f"announced message size {n} is out of range")
    buf = np.zeros(n, np.uint8)
    if leader:
        buf[:] = payload
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return decode_message(buf.tobytes())


def collectives(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """The collective ops of a compiled (partitioned) HLO module and their result shapes.

    Args:
      hlo_text: ``jitted.lower(...).compile().as_text()``.

    Returns:
      ``[(op, shape), ...]`` with op one of ``all-gather``, ``all-reduce``, ``all-to-all``,
      ``collective-permute``, ``reduce-scatter`` (async ``-start`` forms folded in); one
      entry per array in a tuple-shaped result.
    """
    found = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE_RE.search(line)
        if not m:
            continue
        op = m.group("op").removesuffix("-start")
        for s in _SHAPE_RE.finditer(m.group("types")):
            dims = tuple(int(d) for d in s.group("dims").split(",") if d)
            found.append((op, dims))
    return found
