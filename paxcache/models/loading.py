"""HF-format checkpoint loading and saving for the Llama-family model.

A checkpoint directory holds ``config.json`` and either one ``model.safetensors`` or shards
listed in ``model.safetensors.index.json`` (any other ``*.safetensors`` set is also accepted).
Tensors are read one at a time with the ``safetensors`` library (numpy framework), converted
to the requested dtype, and stacked per layer into our ``[L, ...]`` parameters. HF linear
weights ``[out, in]`` are transposed to ``[in, out]``; q/k rows keep HF's rotate-half order.
"""

from __future__ import annotations

import json
import logging
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

from paxcache.errors import PaxcacheError
from paxcache.models.llama import ConfigError, LlamaConfig, LlamaForCausalLM
from paxcache.models.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

TINY_DIR = Path(__file__).resolve().parent / "tiny"

# Our stacked layer param -> (HF suffix under model.layers.{i}., transpose?)
_LAYER_MAP: dict[str, tuple[str, bool]] = {
    "input_layernorm": ("input_layernorm.weight", False),
    "post_attention_layernorm": ("post_attention_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "o_bias": ("self_attn.o_proj.bias", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
}

_LOG_BYTES = 256 * 2**20  # log progress for checkpoints bigger than this


class CheckpointError(PaxcacheError):
    """A checkpoint is unusable: missing file, missing or mis-shaped tensor, bad config.

    A ``paxcache.errors.PaxcacheError``, hence a ``ValueError``.
    """


class MissingFileError(CheckpointError, FileNotFoundError):
    """A required checkpoint file does not exist."""


class MissingTensorError(CheckpointError):
    """A tensor the model needs is absent from the checkpoint."""


class TensorShapeError(CheckpointError):
    """A tensor in the checkpoint has the wrong shape."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's model_type or a config feature is not supported."""


def hf_param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Expected HF tensor name -> shape for a config (HF ``[out, in]`` layout)."""
    e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hd = cfg.num_attention_heads * cfg.head_dim
    kd = cfg.num_key_value_heads * cfg.head_dim
    per_layer = {
        "input_layernorm.weight": (e,),
        "post_attention_layernorm.weight": (e,),
        "self_attn.q_proj.weight": (hd, e),
        "self_attn.k_proj.weight": (kd, e),
        "self_attn.v_proj.weight": (kd, e),
        "self_attn.o_proj.weight": (e, hd),
        "mlp.gate_proj.weight": (f, e),
        "mlp.up_proj.weight": (f, e),
        "mlp.down_proj.weight": (e, f),
    }
    if cfg.qkv_bias:
        per_layer["self_attn.q_proj.bias"] = (hd,)
        per_layer["self_attn.k_proj.bias"] = (kd,)
        per_layer["self_attn.v_proj.bias"] = (kd,)
    if cfg.o_bias:
        per_layer["self_attn.o_proj.bias"] = (e,)
    shapes = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,)}
    for i in range(cfg.num_hidden_layers):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{i}.{suffix}"] = shape
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, e)
    return shapes


def load_config(path: str | os.PathLike[str]) -> LlamaConfig:
    """Reads ``config.json`` from a checkpoint directory.

    Raises:
        MissingFileError: no config.json.
        UnsupportedModelError: unsupported model_type or feature.
        CheckpointError: malformed JSON or fields.
    """
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise MissingFileError(f"checkpoint file not found: {cfg_path}")
    try:
        d = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from e
    mt = d.get("model_type")
    if mt not in ("llama", "mistral", "qwen2"):
        raise UnsupportedModelError(
            f"{cfg_path}: unsupported model_type {mt!r}; supported: llama, mistral, qwen2"
        )
    try:
        return LlamaConfig.from_hf_dict(d)
    except ConfigError as e:
        raise UnsupportedModelError(f"{cfg_path}: {e}") from e


def _tensor_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file containing it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        out = {}
        for name, fname in weight_map.items():
            fpath = path / fname
            if not fpath.is_file():
                raise MissingFileError(
                    f"checkpoint shard not found: {fpath} (listed in {index.name} for {name})"
                )
            out[name] = fpath
        return out
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MissingFileError(
            f"no model.safetensors, model.safetensors.index.json or *.safetensors in {path}"
        )
    out = {}
    for fpath in files:
        with safe_open(str(fpath), framework="np") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a Mapping)
                out[name] = fpath
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
        self.big = sum(p.stat().st_size for p in set(files.values())) > _LOG_BYTES

    def get(self, name: str, shape: tuple[int, ...], np_dtype: Any) -> np.ndarray:
        fpath = self._files.get(name)
        if fpath is None:
            raise MissingTensorError(f"checkpoint is missing tensor {name!r}")
        f = self._open.get(fpath)
        if f is None:
            f = self._open[fpath] = safe_open(str(fpath), framework="np")
        try:
            arr = f.get_tensor(name)
        except Exception as e:  # safetensors raises SafetensorError (not a ValueError)
            raise MissingTensorError(f"cannot read tensor {name!r} from {fpath}: {e}") from e
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


def load_model(
    path: str | os.PathLike[str],
    dtype: Any = jnp.float32,
    param_dtype: Any | None = None,
) -> LlamaForCausalLM:
    """Loads an HF-format checkpoint directory into a ``LlamaForCausalLM``.

    Args:
        path: directory with config.json and safetensors weights.
        dtype: compute dtype (and parameter dtype unless ``param_dtype`` is given).
        param_dtype: storage dtype of parameters.

    Raises:
        MissingFileError, MissingTensorError, TensorShapeError, UnsupportedModelError:
            all ``CheckpointError`` (a ``ValueError``), messages naming the file/tensor/field.
    """
    path = Path(path)
    if not path.is_dir():
        raise MissingFileError(f"checkpoint directory not found: {path}")
    cfg = load_config(path)
    param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
    np_dtype = np.dtype(param_dtype)
    files = _tensor_files(path)
    shapes = hf_param_shapes(cfg)
    total = sum(int(np.prod(s)) for s in shapes.values()) * np_dtype.itemsize
    reader = _Reader(files, total)
    t0 = time.monotonic()
    if reader.big:
        logger.info(
            "loading %s (%s, %.0f MiB in %s)", path, cfg.model_type, total / 2**20, np_dtype.name
        )

    model = nnx.eval_shape(
        lambda: LlamaForCausalLM(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    )

    def put(param: nnx.Param, arr: np.ndarray) -> None:
        param.set_value(jnp.asarray(arr))

    put(
        model.embed_tokens,
        reader.get("model.embed_tokens.weight", shapes["model.embed_tokens.weight"], np_dtype),
    )
    put(model.norm, reader.get("model.norm.weight", shapes["model.norm.weight"], np_dtype))
    if model.lm_head is not None:
        put(model.lm_head, reader.get("lm_head.weight", shapes["lm_head.weight"], np_dtype).T)
    for ours, (suffix, transpose) in _LAYER_MAP.items():
        param = getattr(model.layers, ours)
        if param is None:
            continue
        stacked = np.empty(param.get_value().shape, np_dtype)
        for i in range(cfg.num_hidden_layers):
            name = f"model.layers.{i}.{suffix}"
            arr = reader.get(name, shapes[name], np_dtype)
            stacked[i] = arr.T if transpose else arr
        put(param, stacked)
    if reader.big:
        logger.info("loaded %s in %.1fs", path, time.monotonic() - t0)
    return model


def model_to_hf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """Our parameters as HF-named numpy arrays (``[out, in]`` linear weights)."""
    out: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": np.asarray(model.embed_tokens[...]),
        "model.norm.weight": np.asarray(model.norm[...]),
    }
    if model.lm_head is not None:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(model.lm_head[...]).T)
    for ours, (suffix, transpose) in _LAYER_MAP.items():
        param = getattr(model.layers, ours)
        if param is None:
            continue
        stacked = np.asarray(param[...])
        for i in range(stacked.shape[0]):
            arr = stacked[i].T if transpose else stacked[i]
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
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """Loads a model and its tokenizer.

    Args:
        path: ``"tiny"`` for the bundled byte-level model, or an HF-format directory
            (config.json, ``*.safetensors``; tokenizer.json / tokenizer_config.json optional).
        dtype: compute dtype, e.g. ``jnp.float32`` or ``jnp.bfloat16``.
        param_dtype: parameter storage dtype (default: ``dtype``).

    Returns:
        (model, tokenizer). The tokenizer is byte-level when the directory has no tokenizer.json.

    Raises:
        CheckpointError (a ValueError) subclasses naming the problem.
    """
    p = TINY_DIR if str(path) == "tiny" else Path(path)
    model = load_model(p, dtype=dtype, param_dtype=param_dtype)
    tok = load_tokenizer(p, model.config)
    if tok.vocab_size > model.config.vocab_size:
        logger.warning(
            "tokenizer vocab %d > model vocab %d", tok.vocab_size, model.config.vocab_size
        )
    return model, tok


def param_count(model: LlamaForCausalLM) -> int:
    """Number of parameter scalars in a model."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
