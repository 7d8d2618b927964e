"""HF-format checkpoint loading and saving for the Llama-family model.

A checkpoint directory holds ``config.json`` and either one ``model.safetensors`` or shards
listed in ``model.safetensors.index.json`` (any other ``*.safetensors`` set is also accepted).
Tensors are read one at a time with the ``safetensors`` library (numpy framework), converted
to the requested dtype, and stacked per layer into our ``[L, ...]`` parameters. HF linear
weights ``[out, in]`` are transposed to ``[in, out]``; q/k rows keep HF's rotate-half order.
Fused tensors (Phi-3's ``qkv_proj``, ``gate_up_proj``) are split into our separate q/k/v and
gate/up parameters (:func:`paxcache.models.families.hf_layer_sources`), and fused again by
:func:`save_pretrained`.

A checkpoint is untrusted input (see SECURITY.md). Loading therefore:

* reads only files inside the checkpoint directory: shard names from
  ``model.safetensors.index.json`` must be plain relative names, and every file's resolved path
  (symlinks followed) must stay inside the directory; the one exception is the Hugging Face
  cache layout, where ``snapshots/<rev>/*`` are symlinks into the repository's ``blobs/``;
* checks every ``config.json`` field it uses for type and range (``CONFIG_LIMITS``) before
  anything is sized from it;
* checks every tensor's name, dtype and shape from the safetensors headers before it
  allocates the model, so memory is never sized by a number the weights do not back;
* raises only :class:`CheckpointError` subclasses, naming the file and the field or tensor
  (never a raw ``SafetensorError``, ``TypeError`` or ``KeyError``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from paxcache.errors import CheckpointError
from paxcache.models import quantize
from paxcache.models.families import hf_layer_sources, layer_shapes
from paxcache.models.llama import (
    SUPPORTED_MODEL_TYPES,
    ConfigError,
    LlamaConfig,
    LlamaForCausalLM,
)
from paxcache.models.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

TINY_DIR = Path(__file__).resolve().parent / "tiny"

_LOG_BYTES = 256 * 2**20  # log progress for checkpoints bigger than this

CONFIG_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 19),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 4096),
    "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
    "max_window_layers": (0, 1024),
    "original_max_position_embeddings": (1, 1 << 24),
}
"""Inclusive ``(min, max)`` of the integer ``config.json`` fields, checked before anything is
sized from them. The largest released models are well inside (vocabularies ~256K, hidden size
~16K, ~130 layers, 128 heads, contexts ~10M tokens)."""

_FLOAT_LIMITS: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0),  # exclusive min
    "rope_theta": (0.0, 1e12),
    "partial_rotary_factor": (0.0, 1.0),
}
_REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "use_sliding_window", "mlp_bias")
_MAX_CONFIG_BYTES = 16 << 20
_MAX_INDEX_BYTES = 64 << 20
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


class MissingFileError(CheckpointError, FileNotFoundError):
    """A required checkpoint file does not exist."""


class MissingTensorError(CheckpointError):
    """A tensor the model needs is absent from the checkpoint."""


class TensorShapeError(CheckpointError):
    """A tensor in the checkpoint has the wrong shape."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's model_type or a config feature is not supported."""


def _hf_layer_groups(
    cfg: LlamaConfig,
) -> dict[str, list[tuple[str, bool, tuple[int, int] | None]]]:
    """HF suffix under ``model.layers.{i}.`` -> the (our param, transpose?, rows) it fills."""
    groups: dict[str, list[tuple[str, bool, tuple[int, int] | None]]] = {}
    for ours, (suffix, transpose, rows) in hf_layer_sources(cfg).items():
        groups.setdefault(suffix, []).append((ours, transpose, rows))
    return groups


def hf_param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Expected HF tensor name -> shape for a config (HF ``[out, in]`` layout)."""
    e, v = cfg.hidden_size, cfg.vocab_size
    ours = layer_shapes(cfg)
    per_layer: dict[str, tuple[int, ...]] = {}
    for suffix, targets in _hf_layer_groups(cfg).items():
        shape = ours[targets[0][0]]
        if targets[0][1]:  # a linear weight: ours [in, out], HF [out, in]
            shape = (sum(ours[t[0]][1] for t in targets), shape[0])
        per_layer[suffix] = shape
    shapes = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,)}
    for i in range(cfg.num_hidden_layers):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{i}.{suffix}"] = shape
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, e)
    return shapes


def load_config(path: str | os.PathLike[str]) -> LlamaConfig:
    """Reads and checks ``config.json`` from a checkpoint directory.

    Raises:
        MissingFileError: no config.json.
        UnsupportedModelError: unsupported model_type or feature.
        CheckpointError: malformed JSON, a field of the wrong type or out of
            ``CONFIG_LIMITS``, a file outside the directory; the message names the field.
    """
    root = Path(path)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise MissingFileError(f"checkpoint file not found: {cfg_path}")
    d = _read_json(_confined(root, cfg_path), _MAX_CONFIG_BYTES)
    if not isinstance(d, dict):
        raise CheckpointError(f"{cfg_path}: must hold a JSON object, got {type(d).__name__}")
    mt = d.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{cfg_path}: unsupported model_type {mt!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    check_config_values(d, cfg_path.name)
    try:
        return LlamaConfig.from_hf_dict(d)
    except ConfigError as e:
        raise UnsupportedModelError(f"{cfg_path}: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as e:
        raise CheckpointError(f"{cfg_path}: invalid config: {type(e).__name__}: {e}") from None


def check_config_values(d: Mapping[str, Any], where: str = "config.json") -> None:
    """Checks the type and range of every ``config.json`` field the loader uses.

    Args:
      d: the parsed config.
      where: the file name, for messages.

    Raises:
      CheckpointError: naming the first bad field, its value and the allowed range.
    """

    def bad(field: str, value: Any, want: str) -> CheckpointError:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return CheckpointError(f"{where}: field {field} must be {want}, got {shown}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for field, (lo, hi) in CONFIG_LIMITS.items():
        v = d.get(field)
        optional = field in (
            "num_key_value_heads",
            "head_dim",
            "sliding_window",
            "original_max_position_embeddings",
        )
        if v is None and (optional or field not in _REQUIRED_FIELDS):
            continue
        if not is_int(v) or not lo <= v <= hi:
            raise bad(field, v, f"an int in [{lo}, {hi}]")
    for field, (lo, hi) in _FLOAT_LIMITS.items():
        v = d.get(field)
        if v is None:
            continue
        if (
            not isinstance(v, (int, float))
            or isinstance(v, bool)
            or not math.isfinite(v)
            or not lo < v <= hi
        ):
            raise bad(field, v, f"a finite number in ({lo:g}, {hi:g}]")
    for field in _BOOL_FIELDS:
        v = d.get(field)
        if v is not None and not isinstance(v, bool):
            raise bad(field, v, "true or false")
    for field in ("hidden_act", "torch_dtype"):
        v = d.get(field)
        if v is not None and not isinstance(v, str):
            raise bad(field, v, "a string")
    vocab = d.get("vocab_size")
    for field in ("bos_token_id", "pad_token_id", "eos_token_id"):
        v = d.get(field)
        ids = v if field == "eos_token_id" and isinstance(v, list) else [v]
        if v is None or (isinstance(v, list) and not v):
            continue
        if len(ids) > 1024 or not all(is_int(t) and 0 <= t < vocab for t in ids):
            kind = "a token id or a list of token ids" if field == "eos_token_id" else "a token id"
            raise bad(field, v, f"{kind} in [0, vocab_size={vocab})")
    rs = d.get("rope_scaling")
    if rs is not None:
        if not isinstance(rs, dict):
            raise bad("rope_scaling", rs, "an object or null")
        for k, v in rs.items():
            if k in ("rope_type", "type"):
                if not isinstance(v, str):
                    raise bad(f"rope_scaling.{k}", v, "a string")
            elif (
                isinstance(v, (int, float))
                and not isinstance(v, bool)
                and (not math.isfinite(v) or not 0 < v <= 1e12)
            ):
                raise bad(f"rope_scaling.{k}", v, "a finite number in (0, 1e12]")
    layer_types = d.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list)
        or len(layer_types) != d.get("num_hidden_layers")
        or not all(isinstance(t, str) for t in layer_types)
    ):
        raise bad("layer_types", layer_types, "a list of num_hidden_layers strings")


def _read_json(path: Path, max_bytes: int) -> Any:
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise CheckpointError(f"{path}: {size} bytes, over the {max_bytes >> 20} MiB limit")
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {type(e).__name__}: {e}") from None


def _allowed_roots(root: Path) -> list[Path]:
    """Where a checkpoint's files may resolve to: the directory itself and, for a Hugging
    Face cache snapshot (``models--org--name/snapshots/<rev>``), the repository's ``blobs``."""
    real = root.resolve()
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        roots.append(real.parent.parent / "blobs")
    return roots


def _confined(root: Path, fpath: Path, listed_in: str | None = None) -> Path:
    """``fpath`` with symlinks resolved, if it stays inside the checkpoint directory.

    Raises:
      CheckpointError: it resolves outside (``..``, an absolute path, a symlink pointing out).
    """
    try:
        real = fpath.resolve(strict=True)
    except FileNotFoundError:
        return fpath  # the caller reports the missing file
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise CheckpointError(f"cannot resolve checkpoint file {fpath}: {e}") from None
    if not any(real.is_relative_to(r) for r in _allowed_roots(root)):
        where = f" (listed in {listed_in})" if listed_in else ""
        raise CheckpointError(
            f"checkpoint file {fpath.name}{where} resolves to {real}, outside the checkpoint "
            f"directory {root}; refusing to read it"
        )
    return real


def _open_safetensors(fpath: Path) -> Any:
    try:
        return safe_open(str(fpath), framework="np")
    except Exception as e:  # noqa: BLE001 - SafetensorError is not a ValueError/OSError
        raise CheckpointError(
            f"{fpath.name}: not a valid safetensors file: {type(e).__name__}: {e}"
        ) from None


def _tensor_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file containing it (resolved, inside the checkpoint)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(_confined(path, index), _MAX_INDEX_BYTES)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        out: dict[str, Path] = {}
        checked: dict[str, Path] = {}
        for name, fname in weight_map.items():
            if fname not in checked:
                if not isinstance(fname, str) or not fname:
                    raise CheckpointError(
                        f"{index.name}: weight_map[{name!r}] must be a file name, got {fname!r}"
                    )
                rel = Path(fname)
                if rel.is_absolute() or ".." in rel.parts or "\\" in fname:
                    raise CheckpointError(
                        f"{index.name}: weight_map[{name!r}] = {fname!r} is not a file name "
                        "inside the checkpoint directory"
                    )
                fpath = path / rel
                if not fpath.is_file():
                    raise MissingFileError(
                        f"checkpoint shard not found: {fpath} (listed in {index.name} for {name})"
                    )
                checked[fname] = _confined(path, fpath, index.name)
            out[name] = checked[fname]
        return out
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MissingFileError(
            f"no model.safetensors, model.safetensors.index.json or *.safetensors in {path}"
        )
    out = {}
    for fpath in files:
        real = _confined(path, fpath)
        with _open_safetensors(real) as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a Mapping)
                out[name] = real
    return out


class _Reader:
    """Reads tensors by name, keeping shard files open, logging progress for big loads."""

    def __init__(self, files: Mapping[str, Path], total: int) -> None:
        self._files = files
        self._open: dict[Path, Any] = {}
        self._done = 0
        self._total = total
        self._t0 = time.monotonic()
        self._next_log = _LOG_BYTES
        try:
            size = sum(p.stat().st_size for p in set(files.values()))
        except OSError as e:
            raise CheckpointError(f"cannot stat a checkpoint shard: {e}") from None
        self.big = size > _LOG_BYTES

    def _file(self, name: str) -> tuple[Path, Any]:
        fpath = self._files.get(name)
        if fpath is None:
            raise MissingTensorError(f"checkpoint is missing tensor {name!r}")
        f = self._open.get(fpath)
        if f is None:
            f = self._open[fpath] = _open_safetensors(fpath)
        return fpath, f

    def check(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Checks every tensor's presence, dtype and shape from the file headers alone, so
        nothing is allocated for a checkpoint that cannot load."""
        for name, shape in shapes.items():
            fpath, f = self._file(name)
            try:
                sl = f.get_slice(name)
                got, dtype = tuple(sl.get_shape()), str(sl.get_dtype())
            except Exception as e:  # noqa: BLE001 - SafetensorError
                raise MissingTensorError(
                    f"cannot read tensor {name!r} from {fpath.name}: {type(e).__name__}: {e}"
                ) from None
            if dtype not in _FLOAT_DTYPES:
                raise TensorShapeError(
                    f"tensor {name!r} in {fpath.name} has dtype {dtype}, expected one of "
                    f"{sorted(_FLOAT_DTYPES)}"
                )
            if got != tuple(shape):
                raise TensorShapeError(
                    f"tensor {name!r} in {fpath.name} has shape {got}, expected {tuple(shape)}"
                )

    def get(self, name: str, shape: tuple[int, ...], np_dtype: Any) -> np.ndarray:
        fpath, f = self._file(name)
        try:
            arr = f.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - SafetensorError (not a ValueError)
            raise MissingTensorError(
                f"cannot read tensor {name!r} from {fpath.name}: {type(e).__name__}: {e}"
            ) from None
        if tuple(arr.shape) != tuple(shape):
            raise TensorShapeError(
                f"tensor {name!r} in {fpath.name} has shape {tuple(arr.shape)}, "
                f"expected {tuple(shape)}"
            )
        self._done += arr.nbytes
        if self.big and self._done >= self._next_log:
            self._next_log += _LOG_BYTES
            logger.info(
                "loading checkpoint: %.0f / %.0f MiB (%.1fs)",
                self._done / 2**20,
                self._total / 2**20,
                time.monotonic() - self._t0,
            )
        return arr.astype(np_dtype, copy=False)

    def get_stored(self, name: str, shape: tuple[int, ...], dtypes: set[str]) -> np.ndarray:
        """A tensor in its stored dtype (``I8``, ``F8_E4M3`` or a float), checked against
        ``dtypes`` and ``shape``; float8 is read from the file's bytes (numpy has no fp8)."""
        fpath, f = self._file(name)
        try:
            dtype, got = str(f.get_slice(name).get_dtype()), tuple(f.get_slice(name).get_shape())
        except Exception as e:  # noqa: BLE001 - SafetensorError
            raise MissingTensorError(
                f"cannot read tensor {name!r} from {fpath.name}: {e}"
            ) from None
        if dtype not in dtypes or got != tuple(shape):
            raise TensorShapeError(
                f"tensor {name!r} in {fpath.name} has dtype {dtype} and shape {got}, expected "
                f"one of {sorted(dtypes)} and {tuple(shape)}"
            )
        if dtype != "F8_E4M3":
            return f.get_tensor(name)
        with open(fpath, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            start, end = json.loads(fh.read(n))[name]["data_offsets"]
            fh.seek(8 + n + start)
            raw = np.frombuffer(fh.read(end - start), np.uint8)
        return raw.view(ml_dtypes.float8_e4m3fn).reshape(got)


def load_model(
    path: str | os.PathLike[str],
    dtype: Any = jnp.float32,
    param_dtype: Any | None = None,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Loads an HF-format checkpoint directory into a ``LlamaForCausalLM``.

    Args:
        path: directory with config.json and safetensors weights.
        dtype: compute dtype (and parameter dtype unless ``param_dtype`` is given).
        param_dtype: storage dtype of parameters.
        quantization: None, or one of :data:`paxcache.models.quantize.QUANTIZATIONS`: the
            layers' linear weights are quantized as they are read. A pre-quantized
            (compressed-tensors) checkpoint loads as it is stored; ``quantization`` must then
            be None or its own scheme.

    Raises:
        MissingFileError, MissingTensorError, TensorShapeError, UnsupportedModelError,
            CheckpointError: all ``CheckpointError`` (a ``ValueError``), messages naming the
            file and the tensor or field.
    """
    path = Path(path)
    if not path.is_dir():
        raise MissingFileError(f"checkpoint directory not found: {path}")
    cfg = load_config(path)
    pre = quantize.checkpoint_quantization(
        _read_json(path / "config.json", _MAX_CONFIG_BYTES), quantization
    )
    param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
    np_dtype = np.dtype(param_dtype)
    files = _tensor_files(path)
    shapes = hf_param_shapes(cfg)
    total = sum(int(np.prod(s)) for s in shapes.values()) * np_dtype.itemsize
    reader = _Reader(files, total)
    stored = _prequantized_names(cfg, shapes) if pre is not None else set()
    reader.check({k: v for k, v in shapes.items() if k not in stored})
    t0 = time.monotonic()
    if reader.big:
        logger.info(
            "loading %s (%s, %.0f MiB in %s)", path, cfg.model_type, total / 2**20, np_dtype.name
        )

    rs = cfg.rope_scaling
    if rs and rs.get("rope_type") == "longrope":
        logger.warning(
            "%s: longrope scaling; paged generation of a sequence that crosses "
            "original_max_position_embeddings=%d after its first step keeps the K/V it cached "
            "with the short factors (HF recomputes them with the long ones), so its tokens "
            "from there on can differ from transformers'",
            path,
            rs["original_max_position_embeddings"],
        )

    model = nnx.eval_shape(
        lambda: LlamaForCausalLM(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    )

    def put(param: nnx.Param, arr: Any) -> None:
        param.set_value(arr if isinstance(arr, quantize.QuantizedWeight) else jnp.asarray(arr))

    put(
        model.embed_tokens,
        reader.get("model.embed_tokens.weight", shapes["model.embed_tokens.weight"], np_dtype),
    )
    put(model.norm, reader.get("model.norm.weight", shapes["model.norm.weight"], np_dtype))
    if model.lm_head is not None:
        put(model.lm_head, reader.get("lm_head.weight", shapes["lm_head.weight"], np_dtype).T)
    for suffix, targets in _hf_layer_groups(cfg).items():
        if pre is not None and targets[0][1]:  # a linear weight, stored quantized
            for ours, w in _read_prequantized(reader, pre, cfg, suffix, targets).items():
                put(getattr(model.layers, ours), w)
            continue
        # One read per tensor; a fused one (Phi-3) fills several of our params by rows.
        stacked = {
            t[0]: np.empty(getattr(model.layers, t[0]).get_value().shape, np_dtype) for t in targets
        }
        for i in range(cfg.num_hidden_layers):
            name = f"model.layers.{i}.{suffix}"
            arr = reader.get(name, shapes[name], np_dtype)
            for ours, transpose, rows in targets:
                part = arr if rows is None else arr[rows[0] : rows[1]]
                stacked[ours][i] = part.T if transpose else part
        for ours, arr in stacked.items():
            if quantization is not None and ours in quantize.LINEAR_WEIGHTS:
                arr = quantize.quantize_weight(arr, quantization)  # per tensor, on the host
            put(getattr(model.layers, ours), arr)
    if pre is not None or quantization is not None:
        quantize.apply_quantization(model)
    if reader.big:
        logger.info("loaded %s in %.1fs", path, time.monotonic() - t0)
    return model


def _prequantized_names(cfg: LlamaConfig, shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
    """The tensors a pre-quantized checkpoint stores quantized: every layer linear weight."""
    linear = {suffix for suffix, t in _hf_layer_groups(cfg).items() if t[0][1]}
    return {n for n in shapes if n.startswith("model.layers.") and n.split(".", 3)[3] in linear}


def _read_prequantized(
    reader: _Reader,
    pre: quantize.CheckpointQuantization,
    cfg: LlamaConfig,
    suffix: str,
    targets: list[tuple[str, bool, tuple[int, int] | None]],
) -> dict[str, quantize.QuantizedWeight]:
    """One HF linear weight of every layer, as stored (``weight``, ``weight_scale``, and
    ``input_scale`` for static activations), stacked into our params (``[L, in, out]``)."""
    code = {"int8": "I8", "float8_e4m3fn": "F8_E4M3"}[pre.weight_dtype]
    shapes = hf_param_shapes(cfg)
    qs: dict[str, list[np.ndarray]] = {t[0]: [] for t in targets}
    scales: dict[str, list[np.ndarray]] = {t[0]: [] for t in targets}
    inputs: list[np.ndarray] = []
    for i in range(cfg.num_hidden_layers):
        name = f"model.layers.{i}.{suffix}"
        out_dim = shapes[name][0]
        q = reader.get_stored(name, shapes[name], {code})
        base = name.removesuffix(".weight")
        scale_name = base + ".weight_scale"
        sfile = reader._file(scale_name)[1].get_slice(scale_name)
        sshape = tuple(sfile.get_shape())
        if sshape not in ((out_dim, 1), (out_dim,), (1,), ()):
            raise TensorShapeError(
                f"tensor {scale_name!r} has shape {sshape}, expected ({out_dim}, 1) (channel) or "
                "(1,) (tensor)"
            )
        s = reader.get_stored(scale_name, sshape, _FLOAT_DTYPES).astype(np.float32)
        s = np.broadcast_to(s.reshape(-1, 1), (out_dim, 1))
        if pre.act_static:
            in_name = base + ".input_scale"
            ishape = tuple(reader._file(in_name)[1].get_slice(in_name).get_shape())
            if int(np.prod(ishape)) != 1:
                raise TensorShapeError(f"tensor {in_name!r} has shape {ishape}, expected (1,)")
            inputs.append(reader.get_stored(in_name, ishape, _FLOAT_DTYPES).reshape(1, 1))
        for ours, _, rows in targets:
            lo, hi = (0, out_dim) if rows is None else rows
            qs[ours].append(q[lo:hi].T)
            scales[ours].append(s[lo:hi].T)
    act = np.stack(inputs).astype(np.float32) if pre.act_static else None
    return {
        ours: quantize.stored_weight(pre, np.stack(qs[ours]), np.stack(scales[ours]), act)
        for ours, _, _ in targets
    }


def model_to_hf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """Our parameters as HF-named numpy arrays (``[out, in]`` linear weights)."""
    out: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": np.asarray(model.embed_tokens[...]),
        "model.norm.weight": np.asarray(model.norm[...]),
    }
    if model.lm_head is not None:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(model.lm_head[...]).T)
    for suffix, targets in _hf_layer_groups(model.config).items():
        params = [np.asarray(getattr(model.layers, ours)[...]) for ours, _, _ in targets]
        for i in range(model.config.num_hidden_layers):
            parts = [p[i].T if t[1] else p[i] for p, t in zip(params, targets, strict=True)]
            arr = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(arr)
    return out


def save_pretrained(
    model: LlamaForCausalLM,
    path: str | os.PathLike[str],
    dtype: Any | None = None,
    extra_config: Mapping[str, Any] | None = None,
) -> None:
    """Writes ``config.json`` + ``model.safetensors`` (HF names) to ``path``.

    Args:
        dtype: storage dtype (default: the parameters' dtype).
        extra_config: extra fields merged into config.json.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf_dict()
    if extra_config:
        cfg.update(extra_config)
    tensors = model_to_hf_tensors(model)
    if dtype is not None:
        tensors = {k: v.astype(np.dtype(dtype)) for k, v in tensors.items()}
    cfg["torch_dtype"] = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(
        next(iter(tensors.values())).dtype.name, "float32"
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def load_pretrained(
    path: str | os.PathLike[str] = "tiny",
    dtype: Any = jnp.float32,
    param_dtype: Any | None = None,
    quantization: str | None = None,
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """Loads a model and its tokenizer.

    Args:
        path: ``"tiny"`` for the bundled byte-level model, or an HF-format directory
            (config.json, ``*.safetensors``; tokenizer.json / tokenizer_config.json optional).
        dtype: compute dtype, e.g. ``jnp.float32`` or ``jnp.bfloat16``.
        param_dtype: parameter storage dtype (default: ``dtype``).
        quantization: None, ``"int8"``, ``"int8-w8a8"`` or ``"fp8"`` (see :func:`load_model`).

    Returns:
        (model, tokenizer). The tokenizer is byte-level when the directory has no tokenizer.json.

    Raises:
        CheckpointError (a ValueError) subclasses naming the problem.
    """
    p = TINY_DIR if str(path) == "tiny" else Path(path)
    model = load_model(p, dtype=dtype, param_dtype=param_dtype, quantization=quantization)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        _confined(p, p / name)
    tok = load_tokenizer(p, model.config)
    if tok.vocab_size > model.config.vocab_size:
        logger.warning(
            "tokenizer vocab %d > model vocab %d", tok.vocab_size, model.config.vocab_size
        )
    return model, tok


def param_count(model: LlamaForCausalLM) -> int:
    """Number of parameter scalars in a model."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
