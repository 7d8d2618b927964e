"""HF-format checkpoint loading and saving for the Llama-family model.

A checkpoint directory holds ``config.json`` and either one ``model.safetensors`` or shards
listed in ``model.safetensors.index.json`` (any other ``*.safetensors`` set is also accepted).
Every parameter of ours has one :class:`~paxcache.models.shards.TensorSource` (:func:`hf_sources`,
the per-family table built from :func:`paxcache.models.families.hf_layer_sources`): HF linear
weights ``[out, in]`` are transposed to ``[in, out]``, q/k rows keep HF's rotate-half order,
fused tensors (Phi-3's ``qkv_proj``, ``gate_up_proj``) give our separate q/k/v and gate/up
parameters by rows (fused again by :func:`save_pretrained`), and layer ``i``'s tensor is row
``i`` of our stacked ``[L, ...]`` parameter. The model is built abstractly (``nnx.eval_shape``)
and each parameter is materialised on its target sharding by
:func:`paxcache.models.shards.place_param`, which reads from the memory-mapped safetensors
files only the block each of this process's devices holds, one layer at a time: a model loads
across a ``tp`` mesh (``load_model(..., mesh=)``, ``load_pretrained(..., tp=)``) without ever
being whole on a host or a device. One device is the same path with a one-device sharding.

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

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Container, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from paxcache import sharding
from paxcache.errors import CheckpointError
from paxcache.models import gpt_oss, quantize
from paxcache.models.config_checks import CONFIG_LIMITS, check_config_values  # noqa: F401 (re-exported)
from paxcache.models.families import hf_layer_sources, layer_shapes
from paxcache.models.gemma import GemmaConfig, GemmaForCausalLM
from paxcache.models.llama import (
    SUPPORTED_MODEL_TYPES,
    ConfigError,
    LlamaConfig,
    LlamaForCausalLM,
)
from paxcache.models.moe import (
    MoeConfig,
    MoeForCausalLM,
    expert_sources,
    hf_expert_shapes,
    moe_hf_tensors,
)
from paxcache.models.shards import LAYER, Block, TensorSource, place_param
from paxcache.models.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

TINY_DIR = Path(__file__).resolve().parent / "tiny"

_LOG_BYTES = 256 * 2**20  # log progress for checkpoints bigger than this

_MAX_CONFIG_BYTES = 16 << 20
_MAX_INDEX_BYTES = 64 << 20
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_STORED_CODES = {"int8": "I8", "float8_e4m3fn": "F8_E4M3"}  # pre-quantized weights' dtypes


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


def model_class(cfg: LlamaConfig) -> type[LlamaForCausalLM]:
    """The model class a config builds: :class:`GemmaForCausalLM` for a Gemma config,
    :class:`MoeForCausalLM` for a mixture of experts, else :class:`LlamaForCausalLM`."""
    if isinstance(cfg, GemmaConfig):
        return GemmaForCausalLM
    if isinstance(cfg, gpt_oss.GptOssConfig):
        return gpt_oss.GptOssForCausalLM
    return MoeForCausalLM if isinstance(cfg, MoeConfig) else LlamaForCausalLM


def hf_sources(cfg: LlamaConfig, names: Container[str] = ()) -> dict[tuple[str, ...], TensorSource]:
    """Where every parameter of the model lives in an HF checkpoint (the per-family table).

    Args:
        cfg: the model config.
        names: the checkpoint's tensor names, where the layout depends on them (a mixture
            of experts' per-expert or fused tensors: :func:`paxcache.models.moe.
            expert_sources`; default its per-expert layout).

    Returns:
        Our parameter's attribute path (``("embed_tokens",)``, ``("layers", "q_proj")``) ->
        its source. A family with other tensors adds entries (in
        :func:`paxcache.models.families.hf_layer_sources` for per-layer ones), not a loader.
    """
    out: dict[tuple[str, ...], TensorSource] = {
        ("embed_tokens",): TensorSource("model.embed_tokens.weight"),
        ("norm",): TensorSource("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head",] = TensorSource("lm_head.weight", transpose=True)
    for ours, (suffix, transpose, rows) in hf_layer_sources(cfg).items():
        out["layers", ours] = TensorSource(f"model.layers.{LAYER}.{suffix}", transpose, rows)
    if isinstance(cfg, gpt_oss.GptOssConfig):
        out.update(gpt_oss.gpt_oss_sources(cfg, names))
    elif isinstance(cfg, MoeConfig):
        out.update(expert_sources(cfg, names))
    return out


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
        self.slices = 0
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}
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

    def check(self, shapes: Mapping[str, Any], dtypes: set[str] = _FLOAT_DTYPES) -> dict:
        """Checks every tensor's presence, dtype (one of ``dtypes``) and shape (a tuple, or a
        list of allowed ones) from the file headers alone, so nothing is allocated for a
        checkpoint that cannot load. Returns each tensor's shape."""
        found = {}
        for name, shape in shapes.items():
            fpath, f = self._file(name)
            try:
                sl = f.get_slice(name)
                got, dtype = tuple(sl.get_shape()), str(sl.get_dtype())
            except Exception as e:  # noqa: BLE001 - SafetensorError
                raise MissingTensorError(
                    f"cannot read tensor {name!r} from {fpath.name}: {type(e).__name__}: {e}"
                ) from None
            if dtype not in dtypes:
                raise TensorShapeError(
                    f"tensor {name!r} in {fpath.name} has dtype {dtype}, expected one of "
                    f"{sorted(dtypes)}"
                )
            want = shape if isinstance(shape, list) else [tuple(shape)]
            if got not in want:
                want_s = " or ".join(map(str, want))
                raise TensorShapeError(
                    f"tensor {name!r} in {fpath.name} has shape {got}, expected {want_s}"
                )
            found[name] = got
        return found

    def block(self, name: str, block: Block) -> np.ndarray:
        """``block`` (``(start, stop)`` per axis) of tensor ``name``, as stored, read from the
        memory-mapped file without reading the rest of the tensor."""
        fpath, f = self._file(name)
        try:
            arr = f.get_slice(name)[tuple(slice(a, b) for a, b in block)]
        except Exception as e:  # noqa: BLE001 - SafetensorError (not a ValueError)
            raise MissingTensorError(
                f"cannot read tensor {name!r} from {fpath.name}: {type(e).__name__}: {e}"
            ) from None
        want = tuple(b - a for a, b in block)
        if tuple(arr.shape) != want:
            raise TensorShapeError(
                f"block {block} of tensor {name!r} in {fpath.name} read as shape "
                f"{tuple(arr.shape)}, expected {want}"
            )
        self.slices += 1
        self._done += arr.nbytes
        if self.big and self._done >= self._next_log:
            self._next_log += _LOG_BYTES
            logger.info(
                "loading checkpoint: %.0f / %.0f MiB (%.1fs)",
                self._done / 2**20,
                self._total / 2**20,
                time.monotonic() - self._t0,
            )
        return arr

    @property
    def bytes_read(self) -> int:
        """Bytes of tensor data read so far (only this process's devices' blocks)."""
        return self._done

    def stored_block(self, name: str, block: Block, code: str) -> np.ndarray:
        """``block`` of an 8-bit tensor (``I8`` or ``F8_E4M3``, checked by :meth:`check`) as
        stored, from a memory map of its bytes (numpy cannot slice float8 through safetensors),
        so only that block's pages are read."""
        fpath, _ = self._file(name)
        if fpath not in self._headers:
            with open(fpath, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                self._headers[fpath] = (8 + n, json.loads(fh.read(n)))
        base, header = self._headers[fpath]
        start, end = header[name]["data_offsets"]
        whole = np.memmap(fpath, np.uint8, "r", offset=base + start, shape=(end - start,))
        view = whole.reshape(header[name]["shape"])[tuple(slice(a, b) for a, b in block)]
        arr = np.array(view).view(np.int8 if code == "I8" else ml_dtypes.float8_e4m3fn)
        del whole, view
        self.slices += 1
        self._done += arr.nbytes
        return arr


def load_model(
    path: str | os.PathLike[str],
    dtype: Any = jnp.float32,
    param_dtype: Any | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Loads an HF-format checkpoint directory into a ``LlamaForCausalLM``, straight into
    shards.

    Each parameter is read block by block from the memory-mapped safetensors files, only the
    blocks this process's devices hold (:func:`paxcache.models.shards.place_param`), so peak
    host memory is about two copies of the largest block one device receives and each device
    holds only its shard (plus one layer's shard of one weight while it loads).

    Args:
        path: directory with config.json and safetensors weights.
        dtype: compute dtype (and parameter dtype unless ``param_dtype`` is given).
        param_dtype: storage dtype of parameters.
        mesh: a mesh with a ``"tp"`` axis, and an ``"ep"`` one for expert parallelism
            (:func:`paxcache.sharding.make_mesh`): the parameters are split over it by
            :func:`paxcache.sharding.param_specs`, as ``Engine(..., tp=, ep=)`` expects.
            None: every parameter on this process's first device (``jax.local_devices()[0]``).
        quantization: None, or one of :data:`paxcache.models.quantize.QUANTIZATIONS`: the
            layers' linear weights are quantized as they are read. A pre-quantized
            (compressed-tensors) checkpoint loads as it is stored; ``quantization`` must then
            be None or its own scheme. Not for mixture-of-experts models yet.

    Raises:
        MissingFileError, MissingTensorError, TensorShapeError, UnsupportedModelError,
            CheckpointError: all ``CheckpointError`` (a ``ValueError``), messages naming the
            file and the tensor or field.
        ValueError: the model cannot be split over ``mesh`` (:func:`sharding.validate_tp`,
            :func:`sharding.validate_ep`).
    """
    path = Path(path)
    if not path.is_dir():
        raise MissingFileError(f"checkpoint directory not found: {path}")
    cfg = load_config(path)
    if mesh is not None:
        if sharding.TP_AXIS not in mesh.shape:
            raise ValueError(f"mesh needs a {sharding.TP_AXIS!r} axis, got {dict(mesh.shape)}")
        tp, ep = mesh.shape[sharding.TP_AXIS], mesh.shape.get(sharding.EP_AXIS, 1)
        sharding.validate_tp(cfg, tp, num_devices=mesh.size)
        sharding.validate_ep(cfg, tp, ep, num_devices=mesh.size)
    config_json = _read_json(path / "config.json", _MAX_CONFIG_BYTES)
    mxfp4 = isinstance(cfg, gpt_oss.GptOssConfig) and gpt_oss.checkpoint_mxfp4(config_json)
    if mxfp4:  # gpt-oss's MXFP4 experts: dequantized at load, not a quantized model
        config_json = {k: v for k, v in config_json.items() if k != "quantization_config"}
    pre = quantize.checkpoint_quantization(config_json, quantization)
    kv_type = quantize.checkpoint_kv_cache_type(config_json)
    if (pre is not None or quantization is not None) and isinstance(cfg, MoeConfig):
        raise CheckpointError(
            f"{path}: quantized weights are not supported for mixture-of-experts models "
            f"({cfg.model_type}) yet; load it unquantized"
        )
    param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
    np_dtype = np.dtype(param_dtype)
    files = _tensor_files(path)
    shapes, packed = hf_param_shapes(cfg), {}
    if isinstance(cfg, gpt_oss.GptOssConfig):
        floats, packed = gpt_oss.gpt_oss_hf_shapes(cfg, files, mxfp4)
        shapes.update(floats)
    elif isinstance(cfg, MoeConfig):  # the MLP tensors, in the layout the checkpoint holds
        shapes.update(hf_expert_shapes(cfg, files))
    total = sum(int(np.prod(s)) for s in shapes.values()) * np_dtype.itemsize
    reader = _Reader(files, total)
    stored = _prequantized_names(cfg) if pre is not None else set()
    reader.check({k: v for k, v in shapes.items() if k not in stored})
    reader.check(packed, {"U8"})  # MXFP4 codes and scales
    if pre is not None:
        reader.check({k: shapes[k] for k in stored}, {_STORED_CODES[pre.weight_dtype]})
    if kv_type is not None:  # the checkpoint's KV scales, for an engine's 8-bit cache
        absmax = _checkpoint_kv_absmax(reader, files, cfg.num_hidden_layers, kv_type)
        cfg = dataclasses.replace(cfg, kv_cache_absmax=absmax)
    t0 = time.monotonic()
    if reader.big:
        logger.info(
            "loading %s (%s, %.0f MiB in %s)", path, cfg.model_type, total / 2**20, np_dtype.name
        )

    model = nnx.eval_shape(
        lambda: model_class(cfg)(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    )
    sources = hf_sources(cfg, files)
    quantized = pre is not None or quantization is not None
    read = gpt_oss.mxfp4_reader(reader.block, files) if packed else reader.block
    for key, param, target in _param_targets(model, cfg, sources, mesh):
        src = sources[key]
        if quantized and key[0] == "layers" and key[-1] in quantize.LINEAR_WEIGHTS:
            value = _place_quantized(reader, cfg, pre, quantization, key, src, param, target, mesh)
        else:
            value = place_param(src, param.shape, np_dtype, target, read)
        param.set_value(value)
    if quantized:
        quantize.apply_quantization(model)
    logger.log(
        logging.INFO if reader.big else logging.DEBUG,
        "loaded %s in %.1fs: read %.1f MiB in %d slices (this process's shards of %.1f MiB)",
        path,
        time.monotonic() - t0,
        reader.bytes_read / 2**20,
        reader.slices,
        total / 2**20,
    )
    return model


def _param_targets(
    model: LlamaForCausalLM,
    cfg: LlamaConfig,
    sources: Mapping[tuple[str, ...], TensorSource],
    mesh: jax.sharding.Mesh | None,
) -> list[tuple[tuple[str, ...], nnx.Param, jax.sharding.Sharding]]:
    """``(attribute path, abstract Param, target sharding)`` of every parameter of ``model``.

    Raises:
        UnsupportedModelError: a parameter has no checkpoint source, or a source names a
            parameter the model lacks (the family table and the model disagree).
    """
    state = nnx.state(model, nnx.Param)
    tp = 1 if mesh is None else mesh.shape[sharding.TP_AXIS]
    ep = 1 if mesh is None else mesh.shape.get(sharding.EP_AXIS, 1)
    specs = sharding.param_specs(state, cfg, tp, ep)
    one_device = jax.sharding.make_single_device_sharding(jax.local_devices()[0])
    out = []
    spec_leaves = jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    for path, spec in spec_leaves:
        key = tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)
        while key and key[-1] in ("value", "raw_value"):
            key = key[:-1]
        if key not in sources:
            raise UnsupportedModelError(
                f"{cfg.model_type}: parameter {'.'.join(key)} has no checkpoint source"
            )
        param = model
        for attr in key:
            param = getattr(param, attr)
        target = one_device if mesh is None else jax.sharding.NamedSharding(mesh, spec)
        out.append((key, param, target))
    missing = set(sources) - {k for k, _, _ in out}
    if missing:
        raise UnsupportedModelError(
            f"{cfg.model_type}: the model has no parameter for the checkpoint source(s) "
            f"{sorted('.'.join(k) for k in missing)}"
        )
    return out


def _prequantized_names(cfg: LlamaConfig) -> set[str]:
    """The tensors a pre-quantized checkpoint stores quantized: every layer linear weight."""
    src = hf_sources(cfg)
    linear = [src["layers", n] for n in quantize.LINEAR_WEIGHTS if ("layers", n) in src]
    return {s.tensor(i) for s in linear for i in range(cfg.num_hidden_layers)}


def _place_quantized(
    reader: _Reader,
    cfg: LlamaConfig,
    pre: quantize.CheckpointQuantization | None,
    quantization: str | None,
    key: tuple[str, ...],
    source: TensorSource,
    param: nnx.Param,
    target: jax.sharding.Sharding,
    mesh: jax.sharding.Mesh | None,
) -> quantize.QuantizedWeight:
    """One layer linear weight ``[L, in, out]`` read straight into quantized shards: values
    sharded like the weight, per-output-channel scales ``[L, 1, out]`` split like its output
    axis (:func:`paxcache.sharding.quantized_scale_spec`). Quantized block by block as read
    (:func:`paxcache.models.quantize.place_quantized`), or, for a pre-quantized checkpoint,
    its stored values, ``weight_scale`` and ``input_scale`` read block by block as stored."""
    shape = tuple(param.shape)
    scale_shape = (*shape[:-2], 1, shape[-1])
    if mesh is None:
        scale_target = replicated = target
    else:
        tp = mesh.shape[sharding.TP_AXIS]
        spec = sharding.quantized_scale_spec(key[-1], scale_shape, cfg, tp)
        scale_target = jax.sharding.NamedSharding(mesh, spec)
        replicated = sharding.replicated(mesh)
    if pre is None:
        np_dtype = np.dtype(param.dtype)
        return quantize.place_quantized(
            source, shape, np_dtype, quantization, target, scale_target, reader.block
        )
    code = _STORED_CODES[pre.weight_dtype]
    hf_out = hf_param_shapes(cfg)[source.tensor(0)][0]
    return quantize.place_stored(
        pre,
        source,
        shape,
        (target, scale_target, replicated),
        lambda n, b: reader.stored_block(n, b, code),
        lambda layer, kind: _stored_scale(reader, source.tensor(layer), hf_out, kind),
    )


#: Where a checkpoint keeps a layer's KV cache scales: compressed-tensors' names, then the
#: older output-scale ones of the k/v projections (both as vLLM reads them).
_KV_SCALE_NAMES = ("self_attn.{kv}_scale", "self_attn.{kv}_proj.output_scale")


def _checkpoint_kv_absmax(
    reader: _Reader, files: Mapping[str, Path], num_layers: int, kv_type: str
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-layer K and V abs-max bounds from a ``kv_cache_scheme`` checkpoint's scalar scales
    (``x ~ q * scale`` with ``q`` of ``kv_type``): ``scale * max(kv_type)``.

    Raises:
        MissingTensorError: a layer without a ``k_scale`` / ``v_scale`` (the message names the
            tensor); TensorShapeError: one that is not a scalar; CheckpointError: a scale that
            is not a finite number > 0.
    """
    dt = jnp.dtype(kv_type)
    type_max = float(jnp.iinfo(dt).max if jnp.issubdtype(dt, jnp.integer) else jnp.finfo(dt).max)
    out = []
    for kv in ("k", "v"):
        bounds = []
        for layer in range(num_layers):
            names = [f"model.layers.{layer}.{n.format(kv=kv)}" for n in _KV_SCALE_NAMES]
            name = next((n for n in names if n in files), names[0])
            shape = reader.check({name: [(), (1,)]})[name]
            scale = float(reader.block(name, tuple((0, d) for d in shape)).reshape(-1)[0])
            if not (math.isfinite(scale) and scale > 0):
                raise CheckpointError(
                    f"tensor {name!r}: KV cache scale {scale}; expected a finite number > 0"
                )
            bounds.append(scale * type_max)
        out.append(tuple(bounds))
    return out[0], out[1]


def _stored_scale(reader: _Reader, weight_name: str, out_dim: int, kind: str) -> np.ndarray:
    """A pre-quantized weight's ``weight_scale`` (per channel ``[out, 1]`` / ``[out]``, or per
    tensor ``[1]`` / ``[]``) or ``input_scale`` (``[1]``), as float32 ``[out_dim]``."""
    name = weight_name.removesuffix(".weight") + "." + kind
    allowed = [(out_dim, 1), (out_dim,), (1,), ()] if kind == "weight_scale" else [(1,), ()]
    shape = reader.check({name: allowed})[name]  # per channel, or per tensor
    s = reader.block(name, tuple((0, d) for d in shape)).astype(np.float32)
    return np.broadcast_to(s.reshape(-1), (out_dim,))


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
    if isinstance(model, gpt_oss.GptOssForCausalLM):
        out.update(gpt_oss.gpt_oss_hf_tensors(model))
    elif isinstance(model, MoeForCausalLM):
        out.update(moe_hf_tensors(model))
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
    *,
    tp: int = 1,
    ep: int = 1,
    quantization: str | None = None,
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """Loads a model and its tokenizer.

    Args:
        path: ``"tiny"`` for the bundled byte-level model, or an HF-format directory
            (config.json, ``*.safetensors``; tokenizer.json / tokenizer_config.json optional).
        dtype: compute dtype, e.g. ``jnp.float32`` or ``jnp.bfloat16``.
        param_dtype: parameter storage dtype (default: ``dtype``).
        tp: tensor-parallel degree: the weights are read straight into their shards on the
            mesh ``Engine(..., tp=tp)`` uses (:func:`paxcache.sharding.make_mesh`); 1: one
            device.
        ep: expert-parallel degree (a mixture of experts): the experts are read straight
            into their ``ep`` shards of the ``(ep, tp)`` mesh (:func:`paxcache.sharding.
            expert_specs`); 1: no ``ep`` axis.
        quantization: None, ``"int8"``, ``"int8-w8a8"`` or ``"fp8"`` (see :func:`load_model`).

    Returns:
        (model, tokenizer). The tokenizer is byte-level when the directory has no tokenizer.json.

    Raises:
        CheckpointError (a ValueError) subclasses naming the problem; ValueError for a ``tp``
            the model cannot be split by (:func:`paxcache.sharding.validate_tp`), an ``ep`` it
            cannot use (:func:`paxcache.sharding.validate_ep`).
    """
    p = TINY_DIR if str(path) == "tiny" else Path(path)
    mesh = None
    if isinstance(tp, bool) or isinstance(ep, bool) or tp != 1 or ep != 1:
        cfg = load_config(p)  # both checked before any weight is read
        sharding.validate_tp(cfg, tp)
        sharding.validate_ep(cfg, tp, ep)
        mesh = sharding.make_mesh(tp, ep=ep)
    model = load_model(
        p, dtype=dtype, param_dtype=param_dtype, mesh=mesh, quantization=quantization
    )
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
