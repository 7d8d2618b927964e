"""Quantized weights for the Llama-family model, applied to the model (never written into it).

Schemes (``QUANTIZATIONS``), for the decoder layers' linear weights (q/k/v/o, gate/up/down;
the embeddings, norms and LM head stay in the model's dtype, as vLLM and compressed-tensors
checkpoints keep them):

* ``"int8"``: weight-only int8, one scale per output channel (W8A16).
* ``"int8-w8a8"``: int8 weights as above and int8 activations with one dynamic scale per
  token; the matmul runs on the int8 operands (an ``s8 x s8 -> s32`` dot in the HLO).
* ``"fp8"``: float8 e4m3 weights, one scale per output channel; the matmul dequantizes the
  weight (XLA fuses it), so it runs on every backend.

How it works: a quantized weight is a :class:`QuantizedWeight` (qwix's ``QArray`` plus the
activation scheme of its matmuls) stored in the model's ``nnx.Param`` in place of the array,
stacked ``[L, in, out]`` like the array with scales ``[L, 1, out]``, so the layer ``lax.scan``
slices it like any weight. :func:`apply_quantization` swaps the model's class for a subclass
whose forward methods run under a qwix interception of ``jnp.einsum``: an einsum whose weight
operand is a ``QuantizedWeight`` goes to ``qwix.einsum`` (after quantizing the activation
when the weight asks for it); every other einsum (attention) is untouched.

Why not ``qwix.quantize_model`` with ``qwix.PtqProvider`` (measured on qwix 0.1.8): qwix
finds a weight by looking for an ``nnx.Param`` of the *current* module with the einsum
operand's identity or shape. Our layer weights live in ``LlamaLayers`` and reach the einsum as
per-layer slices of a ``lax.scan`` over the stacked arrays, so it finds none of them (it
quantizes only ``lm_head``, by shape) and would quantize the weights as activations, per call;
its ``WithAux.astype`` then fails on the model's ``w.astype(dtype)``; and an NNX model gets one
intercepted method while ours has two forwards (dense and paged). qwix's numerics (``QArray``,
``qwix.quantize``, ``qwix.einsum`` with its int8 fast path) and its interception are used as
they are.

Scales are stored in bfloat16, rounded up from the float32 ``absmax / qmax`` so no weight
clips, which keeps a layer's bytes at ``1/2 + 1/in`` of bfloat16's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import qwix
from qwix._src import interception  # qwix's thread-local patching (qwix.quantize_model's own)

from paxcache.errors import CheckpointError
from paxcache.models import shards

__all__ = [
    "LINEAR_WEIGHTS",
    "abstract_quantization",
    "place_quantized",
    "place_stored",
    "QUANTIZATIONS",
    "QuantizedWeight",
    "apply_quantization",
    "check_quantization",
    "quantization_of",
    "quantize_weight",
    "quantized_bytes",
    "weight_stats",
]

QUANTIZATIONS = ("int8", "int8-w8a8", "fp8")
"""The ``quantization=`` values (None: the checkpoint's own dtype)."""

LINEAR_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The ``LlamaLayers`` weights a scheme quantizes (stacked ``[L, in, out]``)."""

_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
_SCHEME_DTYPES = {"int8": "int8", "int8-w8a8": "int8", "fp8": "float8_e4m3fn"}
_INTERCEPTED_METHODS = ("hidden_states", "hidden_states_paged", "compute_logits")


@flax.struct.dataclass
class QuantizedWeight(qwix.QArray):
    """A quantized linear weight: ``qvalue * scale`` approximates the weight.

    Attributes:
        qvalue: int8 or float8_e4m3fn ``[..., in, out]`` (stacked: ``[L, in, out]``).
        scale: ``[..., 1, out]`` per-output-channel scales (bfloat16 or float32).
        act_qtype: None (weight-only) or the dtype the matmul's activations are quantized to
            (static; ``"int8"``, ``"float8_e4m3fn"``).
        act_scale: None (dynamic per-token activation scales) or a static activation scale
            ``[..., 1, 1]`` (a compressed-tensors checkpoint's ``input_scale``).
        scheme: the scheme's name (``QUANTIZATIONS``, or the checkpoint's), static.
    """

    act_qtype: Any = flax.struct.field(pytree_node=False, default=None)
    act_scale: jax.Array | None = None
    scheme: str = flax.struct.field(pytree_node=False, default="")

    def astype(self, dtype: Any) -> QuantizedWeight:
        """Unchanged: the matmul takes its compute dtype from the activation."""
        del dtype
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized values and all scales."""
        leaves = (self.qvalue, self.scale, self.act_scale)
        return sum(
            int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves if x is not None
        )


def check_quantization(quantization: str | None) -> None:
    """Raises ValueError naming the value unless it is None or one of ``QUANTIZATIONS``."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r}; expected one of {', '.join(QUANTIZATIONS)} "
            "or None"
        )


def _round_up_scale(scale: np.ndarray) -> np.ndarray:
    """float32 scales -> bfloat16 scales no smaller than them (so nothing clips)."""
    low = scale.astype(ml_dtypes.bfloat16)
    up = np.nextafter(low, np.asarray(np.inf, ml_dtypes.bfloat16))
    return np.where(low.astype(np.float32) < scale, up, low)


def _scale_from_absmax(absmax: np.ndarray, qdtype: str) -> np.ndarray:
    """Per-output-channel ``absmax [1, out]`` (over the whole input axis) -> bfloat16 scale."""
    return _round_up_scale(np.maximum(absmax.astype(np.float32), 1e-12) / _QMAX[qdtype])


def _quantize_with(w: np.ndarray, scale: np.ndarray, qdtype: str) -> np.ndarray:
    """``w [in, out]`` (or a block of its rows) -> qvalues with the given ``scale [1, out]``."""
    ratio = w.astype(np.float32) / scale.astype(np.float32)
    if qdtype == "int8":
        return np.clip(np.rint(ratio), -127, 127).astype(np.int8)
    return np.clip(ratio, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)


def _quantize_array(w: np.ndarray, qdtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``w [in, out]`` -> (qvalue [in, out], bfloat16 scale [1, out]) on the host."""
    w = w.astype(np.float32)
    scale = _scale_from_absmax(np.max(np.abs(w), axis=-2, keepdims=True), qdtype)
    return _quantize_with(w, scale, qdtype), scale


def quantize_weight(weight: Any, quantization: str) -> QuantizedWeight:
    """Quantizes a linear weight with one scale per output channel (on the host, one
    ``[in, out]`` slice at a time, so a stacked weight never has a float32 copy).

    Args:
        weight: ``[..., in, out]`` float array (numpy or JAX; stacked ``[L, in, out]``).
        quantization: one of ``QUANTIZATIONS``.

    Returns:
        A :class:`QuantizedWeight` with ``qvalue [..., in, out]`` and bfloat16 ``scale
        [..., 1, out]``.
    """
    check_quantization(quantization)
    qdtype = _SCHEME_DTYPES[quantization]
    w = np.asarray(weight)
    if w.ndim < 2:
        raise ValueError(f"a linear weight needs [..., in, out], got shape {w.shape}")
    lead = w.shape[:-2]
    flat = w.reshape(-1, *w.shape[-2:])
    parts = [_quantize_array(flat[i], qdtype) for i in range(flat.shape[0])]
    qvalue = np.stack([p[0] for p in parts]).reshape(w.shape)
    scale = np.stack([p[1] for p in parts]).reshape(*lead, 1, w.shape[-1])
    return QuantizedWeight(
        qvalue=jnp.asarray(qvalue),
        scale=jnp.asarray(scale),
        act_qtype="int8" if quantization == "int8-w8a8" else None,
        scheme=quantization,
    )


def _quantize_activation(x: jax.Array, w: QuantizedWeight) -> qwix.QArray | jax.Array:
    """``x [..., in]`` -> a QArray in ``w.act_qtype``: per-token scales, or ``w.act_scale``.

    float8 activations are quantized and dequantized (emulated: the rounding is the
    checkpoint's, the matmul is the compute dtype's), since most backends have no fp8 x fp8
    matmul; int8 activations stay a QArray, so the dot runs on int8 operands.
    """
    qdtype = jnp.dtype(w.act_qtype)
    if w.act_scale is None:
        qx = qwix.quantize(x, qdtype, channelwise_axes=tuple(range(x.ndim - 1)))
    else:
        scale = w.act_scale.astype(jnp.float32).reshape((1,) * x.ndim)
        qmax = _QMAX[qdtype.name]
        ratio = jnp.clip(x.astype(jnp.float32) / scale, -qmax, qmax)
        qvalue = jnp.round(ratio) if qdtype == jnp.int8 else ratio
        qx = qwix.QArray(qvalue=qvalue.astype(qdtype), scale=scale.astype(x.dtype))
    return qx if qdtype == jnp.int8 else qwix.dequantize(qx).astype(x.dtype)


class _QuantizedMatmuls(qwix.QuantizationProvider):
    """Routes ``jnp.einsum(spec, x, w)`` with a :class:`QuantizedWeight` ``w`` to qwix."""

    def __init__(self) -> None:
        super().__init__([])

    def get_intercept_map(self) -> dict[str, Any]:
        return {"jax.numpy.einsum": self.einsum}

    def einsum(self, spec: str, *operands: Any, **kwargs: Any) -> jax.Array:
        if len(operands) != 2 or not isinstance(operands[1], QuantizedWeight):
            return jnp.einsum(spec, *operands, **kwargs)
        x, w = operands
        out_dtype = kwargs.pop("preferred_element_type", None)
        if kwargs:
            raise ValueError(f"quantized einsum: unsupported arguments {sorted(kwargs)}")
        if w.act_qtype is None and _scales_on_output(spec):
            # Weight-only: the matmul on the stored values (int8 / e4m3 are exact in bf16),
            # the per-output-channel scale on the result.
            y = jnp.einsum(spec, x, w.qvalue.astype(x.dtype), preferred_element_type=out_dtype)
            return y * w.scale.reshape(-1).astype(y.dtype)
        rhs = qwix.QArray(qvalue=w.qvalue, scale=w.scale.astype(x.dtype), qtype=w.qtype)
        lhs = x if w.act_qtype is None else _quantize_activation(x, w)
        return qwix.einsum(spec, lhs, rhs, preferred_element_type=out_dtype)


def _scales_on_output(spec: str) -> bool:
    """Whether ``spec`` (``"<x>,<w>-><out>"``) keeps the weight's last (output) axis last."""
    inputs, _, out = spec.replace(" ", "").partition("->")
    w_sub = inputs.split(",")[-1]
    return len(w_sub) == 2 and out.endswith(w_sub[-1]) and w_sub[-1] not in inputs.split(",")[0]


_PROVIDER = _QuantizedMatmuls()


@functools.cache
def _quantized_class(base: type) -> type:
    """``base`` with its forward methods under the quantized-matmul interception (one class
    per base, so every quantized model of a base shares one graphdef type)."""
    interceptor = _PROVIDER.get_interceptors()[0]
    methods = {
        name: interception.wrap_func_intercepted(
            getattr(base, name), interceptor, disable_jit=False
        )
        for name in _INTERCEPTED_METHODS
    }
    return type(base.__name__, (base,), {"_unquantized_type": base, **methods})


def apply_quantization(model: Any, quantization: str | None = None) -> Any:
    """Quantizes a model's layer weights in place and routes their matmuls to qwix.

    Weights that are already :class:`QuantizedWeight` (a loader quantized them as it read
    them, or a pre-quantized checkpoint) are kept; the others among ``LINEAR_WEIGHTS`` are
    quantized with ``quantization``.

    Args:
        model: a ``LlamaForCausalLM`` (or subclass).
        quantization: one of ``QUANTIZATIONS``, or None to only install the interception
            for weights that are already quantized.

    Returns:
        ``model`` (its class becomes the quantized subclass).
    """
    check_quantization(quantization)
    for name in LINEAR_WEIGHTS:
        param = getattr(model.layers, name)
        value = param.get_value()
        if quantization is not None and not isinstance(value, QuantizedWeight):
            param.set_value(quantize_weight(value, quantization))
    base = getattr(type(model), "_unquantized_type", type(model))
    model.__class__ = _quantized_class(base)
    return model


def _quantized(model: Any) -> dict[str, QuantizedWeight]:
    out = {}
    for name in LINEAR_WEIGHTS:
        param = getattr(model.layers, name, None)  # None: e.g. an MoE model's expert MLP
        value = None if param is None else param.get_value()
        if isinstance(value, QuantizedWeight):
            out[name] = value
    return out


def quantization_of(model: Any) -> str | None:
    """The model's quantization scheme (None when no weight is quantized)."""
    schemes = {w.scheme for w in _quantized(model).values()}
    return ", ".join(sorted(schemes)) if schemes else None


def quantized_bytes(model: Any) -> tuple[int, int]:
    """``(bytes of the quantized layer weights with their scales, their bfloat16 bytes)``."""
    weights = _quantized(model).values()
    return sum(w.nbytes for w in weights), sum(2 * int(np.prod(w.shape)) for w in weights)


def weight_stats(model: Any) -> Mapping[str, Any]:
    """``quantization`` (scheme or None) and ``weight_dtype`` (the layer weights' storage
    dtype, e.g. ``int8``, ``float8_e4m3fn``, ``bfloat16``), for ``Engine.stats()``."""
    weights = _quantized(model)
    if weights:
        dtype = ", ".join(sorted({jnp.dtype(w.qvalue.dtype).name for w in weights.values()}))
    else:
        dtype = jnp.dtype(model.layers.q_proj.get_value().dtype).name
    return {"quantization": quantization_of(model), "weight_dtype": dtype}


def describe(model: Any) -> str:
    """One phrase for logs: the compute dtype and the quantization, e.g. ``bfloat16, int8``."""
    q = quantization_of(model)
    return jnp.dtype(model.dtype).name + ("" if q is None else f", {q}")


# ------------------------------------------------------------------------------------------
# Pre-quantized checkpoints (compressed-tensors)
# ------------------------------------------------------------------------------------------

_CT_TOP_FIELDS = {
    "quant_method", "format", "config_groups", "ignore", "quantization_status",
    "kv_cache_scheme", "global_compression_ratio", "sparsity_config", "version",
    "transform_config",
}  # fmt: skip
_CT_ARG_FIELDS = {
    "num_bits", "type", "symmetric", "strategy", "dynamic", "group_size", "block_structure",
    "observer", "observer_kwargs", "actorder",
}  # fmt: skip
_CT_FORMATS = {"float-quantized", "int-quantized", "naive-quantized"}
_LM_HEAD_IGNORES = {"lm_head", "re:.*lm_head", "re:lm_head"}


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """A pre-quantized checkpoint's scheme (compressed-tensors), as the loader reads it.

    Attributes:
        scheme: the matching ``QUANTIZATIONS`` name (what ``quantization=`` may repeat).
        weight_dtype: ``"int8"`` or ``"float8_e4m3fn"``, the stored linear weights' dtype.
        act_qtype: None (weight-only) or the activations' dtype.
        act_static: activations use the checkpoint's ``input_scale`` (else per-token dynamic).
    """

    scheme: str
    weight_dtype: str
    act_qtype: str | None
    act_static: bool


def _ct_args(args: Any, where: str) -> dict[str, Any]:
    if not isinstance(args, Mapping):
        raise CheckpointError(f"{where}: must be an object, got {type(args).__name__}")
    unknown = sorted(set(args) - _CT_ARG_FIELDS)
    if unknown:
        raise CheckpointError(f"{where}.{unknown[0]}: field not understood by the loader")
    if args.get("num_bits") != 8:
        raise CheckpointError(
            f"{where}.num_bits: {args.get('num_bits')!r} is not supported (only 8-bit weights "
            "and activations; int4 checkpoints need int4 matmuls, which paxcache does not run)"
        )
    if args.get("type") not in ("int", "float"):
        raise CheckpointError(f"{where}.type: {args.get('type')!r}; expected 'int' or 'float'")
    if args.get("symmetric", True) is not True:
        raise CheckpointError(f"{where}.symmetric: asymmetric (zero-point) is not supported")
    for field in ("group_size", "block_structure", "actorder"):
        if args.get(field) is not None:
            raise CheckpointError(f"{where}.{field}: {args[field]!r} is not supported")
    return dict(args)


def checkpoint_quantization(
    config: Mapping[str, Any], quantization: str | None
) -> CheckpointQuantization | None:
    """Reads ``quantization_config`` from a parsed ``config.json``; None for a plain one.

    Args:
        config: the parsed config.json.
        quantization: what the caller asked for; with a pre-quantized checkpoint it must be
            None or the checkpoint's own scheme.

    Raises:
        CheckpointError: a quantization method or field the loader does not understand (the
            message names the field), AWQ / GPTQ / int4 checkpoints, or ``quantization`` that
            names another scheme than the checkpoint's.
    """
    check_quantization(quantization)
    qc = config.get("quantization_config")
    if qc is None:
        return None
    where = "config.json: quantization_config"
    if not isinstance(qc, Mapping):
        raise CheckpointError(f"{where}: must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method in ("awq", "gptq", "bitsandbytes", "marlin", "gptq_marlin"):
        raise CheckpointError(
            f"{where}.quant_method: {method!r} (int4 weights) is not supported: paxcache runs "
            "int8 and fp8 weights only; load a bf16 checkpoint with quantization='int8' instead"
        )
    if method != "compressed-tensors":
        raise CheckpointError(
            f"{where}.quant_method: {method!r} is not supported (only 'compressed-tensors')"
        )
    unknown = sorted(set(qc) - _CT_TOP_FIELDS)
    if unknown:
        raise CheckpointError(f"{where}.{unknown[0]}: field not understood by the loader")
    if not qc.get("config_groups") and qc.get("kv_cache_scheme"):
        # only the KV cache is quantized (checkpoint_kv_cache_type reads it); weights as stored
        if qc.get("format") not in (*_CT_FORMATS, "dense", None):
            raise CheckpointError(f"{where}.format: {qc.get('format')!r} is not supported")
        return None
    if qc.get("format") not in _CT_FORMATS:
        raise CheckpointError(
            f"{where}.format: {qc.get('format')!r} is not supported; expected one of "
            f"{sorted(_CT_FORMATS)}"
        )
    if qc.get("quantization_status", "compressed") not in ("compressed", "frozen"):
        raise CheckpointError(
            f"{where}.quantization_status: {qc['quantization_status']!r}; expected 'compressed'"
        )
    for field in ("sparsity_config", "transform_config"):
        if qc.get(field):
            raise CheckpointError(f"{where}.{field}: {qc[field]!r} is not supported")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or set(ignore) - _LM_HEAD_IGNORES:
        raise CheckpointError(
            f"{where}.ignore: {ignore!r}; only the LM head may stay unquantized (every layer's "
            "q/k/v/o and MLP projections are loaded quantized)"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise CheckpointError(f"{where}.config_groups: expected exactly one group")
    ((gname, group),) = groups.items()
    gwhere = f"{where}.config_groups.{gname}"
    if not isinstance(group, Mapping):
        raise CheckpointError(f"{gwhere}: must be an object")
    unknown = sorted(
        set(group) - {"targets", "weights", "input_activations", "output_activations", "format"}
    )
    if unknown:
        raise CheckpointError(f"{gwhere}.{unknown[0]}: field not understood by the loader")
    if group.get("targets") != ["Linear"]:
        raise CheckpointError(f"{gwhere}.targets: {group.get('targets')!r}; expected ['Linear']")
    if group.get("output_activations") is not None:
        raise CheckpointError(f"{gwhere}.output_activations: not supported")
    w = _ct_args(group.get("weights"), f"{gwhere}.weights")
    if w.get("strategy") not in ("channel", "tensor") or w.get("dynamic", False):
        raise CheckpointError(
            f"{gwhere}.weights.strategy: {w.get('strategy')!r} (dynamic={w.get('dynamic')}); "
            "expected static 'channel' or 'tensor' scales"
        )
    weight_dtype = "int8" if w["type"] == "int" else "float8_e4m3fn"
    act_qtype, act_static = None, False
    if group.get("input_activations") is not None:
        a = _ct_args(group["input_activations"], f"{gwhere}.input_activations")
        if a.get("type") != w["type"]:
            raise CheckpointError(f"{gwhere}.input_activations.type: must match the weights'")
        act_static = not a.get("dynamic", False)
        want = "tensor" if act_static else "token"
        if a.get("strategy") != want:
            raise CheckpointError(
                f"{gwhere}.input_activations.strategy: {a.get('strategy')!r}; expected "
                f"{want!r} for dynamic={a.get('dynamic', False)}"
            )
        act_qtype = weight_dtype
    if weight_dtype == "float8_e4m3fn":
        scheme = "fp8"
    else:
        scheme = "int8" if act_qtype is None else "int8-w8a8"
    if quantization is not None and quantization != scheme:
        raise CheckpointError(
            f"quantization={quantization!r} given for a checkpoint pre-quantized as {scheme!r} "
            f"({where}); pass quantization=None or {scheme!r}"
        )
    return CheckpointQuantization(scheme, weight_dtype, act_qtype, act_static)


def checkpoint_kv_cache_type(config: Mapping[str, Any]) -> str | None:
    """The 8-bit type a compressed-tensors ``kv_cache_scheme`` quantizes K and V to
    (``"int8"`` or ``"float8_e4m3fn"``), None when the checkpoint has none.

    The scheme must be static, symmetric, 8-bit, one scale per layer for K and one for V
    (``strategy: "tensor"``): the checkpoint's ``self_attn.k_scale`` / ``v_scale`` tensors.

    Raises:
        CheckpointError: a field the loader does not understand or a scheme it cannot use,
            named (a per-channel or per-head strategy, dynamic scales, zero points, 4 bits).
    """
    qc = config.get("quantization_config")
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "compressed-tensors":
        return None
    kv = qc.get("kv_cache_scheme")
    if not kv:
        return None
    where = "config.json: quantization_config.kv_cache_scheme"
    args = _ct_args(kv, where)
    if args.get("strategy", "tensor") != "tensor" or args.get("dynamic", False):
        raise CheckpointError(
            f"{where}.strategy: {args.get('strategy')!r} (dynamic={args.get('dynamic')}); "
            "paxcache's 8-bit caches take one static scale per layer for K and V ('tensor')"
        )
    return "int8" if args["type"] == "int" else "float8_e4m3fn"


def stored_weight(
    spec: CheckpointQuantization,
    qvalue: np.ndarray,
    weight_scale: np.ndarray,
    input_scale: np.ndarray | None,
) -> QuantizedWeight:
    """One stacked weight of a pre-quantized checkpoint as a :class:`QuantizedWeight`.

    Args:
        spec: the checkpoint's scheme.
        qvalue: ``[L, in, out]`` int8 / float8_e4m3fn (already in our ``[in, out]`` layout).
        weight_scale: f32 ``[L, 1, out]``.
        input_scale: f32 ``[L, 1, 1]`` when the activations are static, else None.
    """
    return QuantizedWeight(
        qvalue=jnp.asarray(qvalue),
        scale=jnp.asarray(weight_scale, jnp.float32),
        act_qtype=spec.act_qtype,
        act_scale=None if input_scale is None else jnp.asarray(input_scale, jnp.float32),
        scheme=spec.scheme,
    )


def abstract_quantization(model: Any, quantization: str) -> Any:
    """An abstract model (``nnx.eval_shape``) with its layer weights as abstract
    :class:`QuantizedWeight`\\ s of ``quantization`` (for compiling without weights)."""
    check_quantization(quantization)
    qdtype = jnp.dtype(_SCHEME_DTYPES[quantization])
    for name in LINEAR_WEIGHTS:
        param = getattr(model.layers, name)
        shape = tuple(param.get_value().shape)
        param.set_value(
            QuantizedWeight(
                qvalue=jax.ShapeDtypeStruct(shape, qdtype),
                scale=jax.ShapeDtypeStruct((*shape[:-2], 1, shape[-1]), jnp.bfloat16),
                act_qtype="int8" if quantization == "int8-w8a8" else None,
                scheme=quantization,
            )
        )
    return apply_quantization(model)


# ------------------------------------------------------------------------------------------
# Quantize-at-load (the sharded loader's per-block hook)
# ------------------------------------------------------------------------------------------


class _LayerScales:
    """The per-output-channel scales of one stacked linear weight ``[L, in, out]``, per
    ``(layer, output columns)``, each from that layer's whole input axis.

    A block holding every input row of its columns (tp=1, column-parallel shards) gives its
    columns' scales itself; a block split along the input axis (a row-parallel shard at tp>1)
    does not, so those columns are read over the whole input axis once, in row chunks the size
    of the block, for the absmax. Every shard therefore uses the unsharded model's scales.
    """

    def __init__(
        self,
        read: shards.ReadSlice,
        source: shards.TensorSource,
        in_dim: int,
        dtype: Any,
        chunk_rows: int,
    ) -> None:
        self._read, self._source, self._in, self._dtype = read, source, in_dim, dtype
        self._chunk = max(1, chunk_rows)
        self._absmax: dict[tuple[int | None, tuple[int, int]], np.ndarray] = {}

    def absmax(
        self, layer: int | None, cols: tuple[int, int], block: np.ndarray | None = None
    ) -> np.ndarray:
        """``absmax [1, cols]`` of ``layer``'s columns ``cols`` over every input row;
        ``block`` (all rows of those columns, already read) is used instead of a read."""
        key = (layer, cols)
        if key not in self._absmax:
            if block is not None:
                amax = np.max(np.abs(block.astype(np.float32)), axis=0, keepdims=True)
            else:
                amax = np.zeros((1, cols[1] - cols[0]), np.float32)
                for r in range(0, self._in, self._chunk):
                    rows = (r, min(r + self._chunk, self._in))
                    block_rc = (rows, cols)
                    part = shards.read_block(self._read, self._source, layer, block_rc, self._dtype)
                    amax = np.maximum(amax, np.max(np.abs(part.astype(np.float32)), axis=0))
            self._absmax[key] = amax
        return self._absmax[key]


def place_quantized(
    source: shards.TensorSource,
    shape: tuple[int, ...],
    dtype: Any,
    quantization: str,
    weight_sharding: jax.sharding.Sharding,
    scale_sharding: jax.sharding.Sharding,
    read: shards.ReadSlice,
) -> QuantizedWeight:
    """Reads one linear weight from the checkpoint straight into quantized shards.

    Each host block is read, cast to ``dtype`` (the model's parameter dtype, as an
    unquantized load would store it), quantized with its columns' per-output-channel scales
    and only then copied to its device (:func:`paxcache.models.shards.place_param`), one layer
    at a time, so the float weight is never on a device. The result equals
    :func:`quantize_weight` of the unquantized stacked weight, whatever the sharding.

    Args:
        source: the weight's checkpoint source (stacked ``{layer}``, or not).
        shape: the weight's shape ``[L, in, out]`` (or ``[in, out]``).
        dtype: the parameter dtype the float weight is cast to before quantizing.
        quantization: one of ``QUANTIZATIONS``.
        weight_sharding: the values' sharding (the weight's).
        scale_sharding: the scales' sharding ``[L, 1, out]``
            (:func:`paxcache.sharding.quantized_scale_spec`).
        read: the checkpoint reader.
    """
    check_quantization(quantization)
    qdtype = _SCHEME_DTYPES[quantization]
    dtype = np.dtype(dtype)
    in_dim = shape[-2]
    shard_rows = weight_sharding.shard_shape(tuple(shape))[-2]  # rows one device holds
    scales = _LayerScales(read, source, in_dim, dtype, shard_rows)

    def qvalue_block(layer: int | None, block: shards.Block) -> np.ndarray:
        rows, cols = block[-2], block[-1]
        w = shards.read_block(read, source, layer, block, dtype)
        whole = rows == (0, in_dim)
        amax = scales.absmax(layer, cols, w if whole else None)
        return _quantize_with(w, _scale_from_absmax(amax, qdtype), qdtype)

    def scale_block(layer: int | None, block: shards.Block) -> np.ndarray:
        return _scale_from_absmax(scales.absmax(layer, block[-1]), qdtype)

    qvalue = shards.place_param(source, shape, qdtype, weight_sharding, read, qvalue_block)
    scale_shape = (*shape[:-2], 1, shape[-1])
    scale = shards.place_param(
        source, scale_shape, ml_dtypes.bfloat16, scale_sharding, read, scale_block
    )
    return QuantizedWeight(
        qvalue=qvalue,
        scale=scale,
        act_qtype="int8" if quantization == "int8-w8a8" else None,
        scheme=quantization,
    )


def place_stored(
    spec: CheckpointQuantization,
    source: shards.TensorSource,
    shape: tuple[int, ...],
    targets: tuple[jax.sharding.Sharding, jax.sharding.Sharding, jax.sharding.Sharding],
    read_stored: shards.ReadSlice,
    read_scale: Any,
) -> QuantizedWeight:
    """One linear weight of a pre-quantized checkpoint read block by block, as stored, into
    its shards (the same :func:`paxcache.models.shards.place_param` path as a float weight).

    Args:
        spec: the checkpoint's scheme.
        source: the weight's checkpoint source (its stored 8-bit ``[out, in]`` tensors).
        shape: the weight's shape ``[L, in, out]``.
        targets: the shardings of the values (the weight's), of the scales ``[L, 1, out]``
            and of the static activation scales ``[L, 1, 1]`` (replicated).
        read_stored: reads a block of a stored 8-bit tensor.
        read_scale: ``read_scale(layer, kind)`` -> float32 ``[hf_out]`` of that layer's
            ``"weight_scale"`` (per channel; a per-tensor scale broadcast) or
            ``"input_scale"`` (``[1]``).
    """
    qdtype = np.dtype(jnp.dtype(spec.weight_dtype))
    lo = 0 if source.rows is None else source.rows[0]  # a fused tensor's rows

    def scale_block(layer: int | None, block: shards.Block) -> np.ndarray:
        (c0, c1) = block[-1]
        return np.ascontiguousarray(read_scale(layer, "weight_scale")[lo + c0 : lo + c1][None])

    def act_block(layer: int | None, block: shards.Block) -> np.ndarray:
        return np.ascontiguousarray(read_scale(layer, "input_scale")[:1].reshape(1, 1))

    values, scales, replicated = targets
    qvalue = shards.place_param(source, shape, qdtype, values, read_stored)
    lead = shape[:-2]
    scale = shards.place_param(
        source, (*lead, 1, shape[-1]), np.float32, scales, read_stored, scale_block
    )
    act = None
    if spec.act_static:
        act = shards.place_param(
            source, (*lead, 1, 1), np.float32, replicated, read_stored, act_block
        )
    return stored_weight(spec, qvalue, scale, act)
