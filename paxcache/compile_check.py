"""Compile the serving engine for a TPU chip on a host without one (``scripts/compile_check.py``).

``pip install "jax[tpu]"`` brings libtpu, whose compiler runs anywhere: an abstract topology
(``v5e:2x2``, ``v6e:2x2``, ``v4:2x2x1``, ...) has devices that programs can be compiled for
but not run. :func:`check_engine` builds the real :class:`~paxcache.engine.Engine` from an
abstract model (an HF ``config.json``, no weights) on such devices and compiles, exactly as
``Engine.warmup`` would on the chip:

* the engine's fused step (allocator ``append`` -> copy-on-write copies -> model with KV
  writes and ragged paged attention in every layer -> sampling -> ``commit``) for every
  warm-up token bucket, sharded over ``tp`` chips;
* every KV-movement program: the copy-on-write copies (inside the step) and, with a host
  pool, swap out and swap in for every pair bucket.

Per program it reports whether it compiled, the compile time, which implementation each
kernel op got (``kernels_pallas.kernel_info``; a Mosaic kernel that fails to compile falls
back to XLA, which is reported as a failure here), and XLA's memory analysis per chip
(arguments = weights + KV cache + block state, temporaries, total HBM) next to the engine's
own KV sizing for that chip's HBM (``0.9`` of what the weights leave free, as
``Engine(num_blocks=None)`` sizes it on a live chip). The engine is built with the same
placement interface it uses on a live chip (:class:`~paxcache.placement.Placement`):
:class:`AbstractPlacement` only swaps concrete arrays for abstract ones.

:func:`check_kernels` compiles the kernel grid (``kernels_pallas.aot.kernel_grid``).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, make_single_device_sharding

import kernels_pallas
from kernels_pallas import aot, compat
from paxcache import allocator, kv_cache, kv_quant, sharding, sizing
from paxcache import step as step_lib
from paxcache.engine import Engine
from paxcache.models import quantize
from paxcache.models.llama import SUPPORTED_MODEL_TYPES, LlamaConfig, LlamaForCausalLM
from paxcache.models.loading import model_class
from paxcache.placement import Placement

__all__ = [
    "AbstractEngine",
    "AbstractPlacement",
    "abstract_model",
    "check_engine",
    "check_kernels",
    "export_step",
    "format_report",
    "lower_step",
]

_GIB = float(1 << 30)


def load_hf_config(path: str | Path) -> LlamaConfig:
    """An HF ``config.json`` (the file or its directory) as a :class:`LlamaConfig`.

    Raises:
      ValueError: missing file, bad JSON or an unsupported ``model_type``.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"config not found: {path}")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if d.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path}: unsupported model_type {d.get('model_type')!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return LlamaConfig.from_hf_dict(d)


def abstract_model(
    config: LlamaConfig, dtype: Any, quantization: str | None = None
) -> LlamaForCausalLM:
    """The model (its family's class) with ``ShapeDtypeStruct`` parameters: no weights; its
    layer weights quantized (abstractly) when ``quantization`` names a scheme."""
    cls = model_class(config)
    model = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)))
    return model if quantization is None else quantize.abstract_quantization(model, quantization)


class _NoTokenizer:
    eos_token_id = None


def _abstract(x: Any, sharding_: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding_)


def _bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a pytree of sharded ``ShapeDtypeStruct``s."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
    return total


class AbstractPlacement(Placement):
    """:class:`~paxcache.placement.Placement` on abstract values: weights, block state and KV
    cache are ``ShapeDtypeStruct``s on ``devices`` (a TPU topology's, or host devices standing
    in for a GPU), the engine takes ``backend``'s defaults, and KV sizing sees the chip's HBM
    less this chip's share of the weights. Nothing placed here runs (``runs = False``: no 8-bit
    KV calibration; an 8-bit cache's scales are ``f32[L]`` placeholders whose values do not
    change a compiled program).

    Args:
      devices: the target devices (``kernels_pallas.aot.tpu_devices(name)``).
      hbm_bytes: HBM of one chip (default ``kernels_pallas.aot.hbm_bytes(devices[0])``).
      backend: whose defaults the engine takes (``"tpu"``, or ``"gpu"``).
    """

    runs = False

    def __init__(self, devices: list, hbm_bytes: int | None = None, backend: str = "tpu") -> None:
        self.devices = list(devices)
        self._backend = backend
        self.hbm_bytes = hbm_bytes or aot.hbm_bytes(self.devices[0])
        if self.hbm_bytes is None:
            raise ValueError(
                f"unknown HBM size for {self.devices[0].device_kind!r}; pass hbm_bytes"
            )
        self.weights_bytes_per_device = 0  # set by place_params

    def backend(self) -> str:
        return self._backend  # its defaults (batch limits, KV sizing), whatever this host is

    def memory_stats(self) -> dict[str, int]:
        stats = {"bytes_limit": int(self.hbm_bytes), "bytes_in_use": self.weights_bytes_per_device}
        if self._backend == "gpu":  # XLA's pool as paxcache.sizing.configure_gpu_allocator sets it
            stats.update(
                bytes_limit=int(sizing.GPU_POOL_FRACTION * self.hbm_bytes),
                device_total_bytes=int(self.hbm_bytes),
            )
        return stats

    def place_params(self, model: Any, params: Any, tp: int, ep: int) -> tuple[Any, Any]:
        sharding.validate_tp(model.config, tp, num_devices=len(self.devices))
        sharding.validate_ep(model.config, tp, ep, num_devices=len(self.devices))
        if tp == ep == 1:
            one = make_single_device_sharding(self.devices[0])
            mesh, placed = None, jax.tree.map(lambda x: _abstract(x, one), params)
        else:
            mesh = sharding.make_mesh(tp, self.devices, ep=ep)
            specs = sharding.param_specs(params, model.config, tp, ep)
            placed = jax.tree.map(lambda x, s: _abstract(x, NamedSharding(mesh, s)), params, specs)
        self.weights_bytes_per_device = _bytes_per_device(placed)
        return mesh, placed

    def init_state(self, cache_config: Any, mesh: Any) -> Any:
        state = jax.eval_shape(lambda: allocator.init(cache_config))
        where = (
            make_single_device_sharding(self.devices[0])
            if mesh is None
            else sharding.replicated(mesh)
        )
        return jax.tree.map(lambda x: _abstract(x, where), state)

    def create_kv(self, mesh: Any, **dims: Any) -> kv_cache.KVCache:
        def place(num_blocks: int, memory_kind: str | None) -> kernels_pallas.PagedKVCache:
            shape = kernels_pallas.kv_cache_shape(
                dims["num_layers"],
                num_blocks,
                dims["block_size"],
                dims["num_kv_heads"],
                dims["head_dim"],
                dims["dtype"],
                platform=self.devices[0].platform,
            )
            if mesh is None:
                where = make_single_device_sharding(self.devices[0], memory_kind=memory_kind)
                return jax.tree.map(lambda x: _abstract(x, where), shape)
            specs = kernels_pallas.kv_cache_specs(sharding.TP_AXIS, like=shape)
            return jax.tree.map(
                lambda x, spec: _abstract(x, NamedSharding(mesh, spec, memory_kind=memory_kind)),
                shape,
                specs,
            )

        host = None
        if dims.get("num_host_blocks"):
            host = place(dims["num_host_blocks"], "pinned_host")
        return kv_cache.KVCache(device=place(dims["num_blocks"], None), host=host)


class AbstractEngine(Engine):
    """The serving engine on abstract values for the devices of a TPU topology (or, with
    ``target_backend="gpu"``, host devices standing in for a GPU: :meth:`export_step`): the
    :class:`Engine` itself, built with an :class:`AbstractPlacement`. Nothing can run,
    everything can be compiled: ``self._jit_step.trace(*self._empty_step_args(t)).lower()
    .compile()``.

    Args:
      model: from :func:`abstract_model`.
      devices: the target devices (``kernels_pallas.aot.tpu_devices(name)``).
      hbm_bytes: HBM of one chip (default ``kernels_pallas.aot.hbm_bytes(devices[0])``).
      target_backend: whose defaults the engine takes (``"tpu"``; ``"gpu"`` for an engine
        exported under ``aot.cuda_target``, placed on host devices: ``jax.devices("cpu")``).
      **kwargs: :class:`~paxcache.engine.Engine` options (``tp``, ``block_size``, ...).
    """

    def __init__(
        self,
        model: Any,
        devices: list,
        *,
        hbm_bytes: int | None = None,
        target_backend: str = "tpu",
        **kwargs: Any,
    ) -> None:
        where = AbstractPlacement(devices, hbm_bytes, target_backend)
        super().__init__(model, _NoTokenizer(), placement=where, **kwargs)

    @property
    def weights_bytes_per_device(self) -> int:
        return self.placement.weights_bytes_per_device

    def export_step(self, num_tokens: int | None = None, **kwargs: Any) -> jax.export.Exported:
        """:func:`export_step` of this engine (e.g. under ``aot.cuda_target("9.0")``)."""
        return export_step(self, num_tokens, **kwargs)


# --------------------------------------------------------------------------------------------
# The engine's step, lowered or exported (HLO inspection, other targets)
# --------------------------------------------------------------------------------------------


def _step_args(
    engine: Engine, num_tokens: int | None, decode: bool, masked: bool, loop: bool = False
) -> tuple:
    t = engine.buckets[-1] if num_tokens is None else int(num_tokens)
    if t not in engine.buckets:
        raise ValueError(f"num_tokens={t} is not one of the engine's buckets {engine.buckets}")
    if decode and t not in engine.decode_buckets:
        raise ValueError(
            f"no decode-only program for T={t} (decode buckets: {engine.decode_buckets})"
        )
    loops = step_lib.loop_buckets(engine._shapes)
    if loop and t not in loops:
        raise ValueError(f"no multi-step decode for T={t} (its buckets: {loops})")
    return engine._empty_step_args(t, masked=masked, decode=decode, loop=loop)


def lower_step(
    engine: Engine,
    num_tokens: int | None = None,
    *,
    decode: bool = False,
    masked: bool = False,
    loop: bool = False,
) -> jax.stages.Lowered:
    """The engine's fused step for the token bucket ``num_tokens`` (default: the largest),
    lowered for the engine's own devices: ``.as_text()`` is its StableHLO,
    ``.compile().as_text()`` the optimised HLO. ``decode`` / ``masked`` / ``loop``: the
    decode-only / constrained / multi-step decode variants. Nothing runs and the engine's
    state is untouched.

    Raises:
      ValueError: ``num_tokens`` is not a bucket (or not a decode bucket with ``decode``).
    """
    args = _step_args(engine, num_tokens, decode, masked, loop)
    return engine._jit_step.trace(*args).lower()


def export_step(
    engine: Engine,
    num_tokens: int | None = None,
    *,
    platforms: tuple[str, ...] = ("cuda",),
    decode: bool = False,
    masked: bool = False,
    loop: bool = False,
) -> jax.export.Exported:
    """The engine's fused step exported for ``platforms`` (``jax.export``): the whole program
    the engine would run there, kernels included, from any host. Inside
    ``kernels_pallas.aot.cuda_target("8.0")`` a CUDA export assumes that compute capability
    (``kernels_pallas.kernel_info("cuda")`` then says what each op got); ``.mlir_module()``
    is its StableHLO. Arguments as :func:`lower_step`. The export allows the Pallas Triton
    call (``kernels_pallas.compat.TRITON_EXPORT_CHECKS``: Triton IR has no serialization
    guarantee), which a CUDA step holds on every compute capability from 8.0.
    """
    args = _step_args(engine, num_tokens, decode, masked, loop)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), args)
    exported = jax.export.export(
        engine._jit_step,
        platforms=list(platforms),
        disabled_checks=compat.TRITON_EXPORT_CHECKS,
    )
    return exported(*abstract)


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def _error_text(e: BaseException) -> str:
    first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first}"[:500]


def _memory(compiled: Any) -> dict[str, int]:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
        "host_argument_size_in_bytes",
        "host_temp_size_in_bytes",
    )
    out = {f.removesuffix("_size_in_bytes"): int(getattr(m, f, 0) or 0) for f in fields}
    out["total_hbm"] = (
        out["argument"] + out["output"] - out["alias"] + out["temp"] + out["generated_code"]
    )
    return out


def _compile_program(name: str, kind: str, jitted: Any, args: tuple, hbm: int) -> dict:
    result: dict[str, Any] = {"name": name, "kind": kind}
    t0 = time.perf_counter()
    kernels: dict[str, str] = {}
    try:
        if kind == "step":  # its kernels are recorded as it traces: a trace the sizing
            jitted.clear_cache()  # probe made over this very cache would record nothing
        with kernels_pallas.compile_probes(), kernels_pallas.recording() as seen:
            traced = jitted.trace(*args)
        kernels = seen.get("tpu", {})
        if kind != "step":  # the swap program was chosen when it was built, not traced
            kernels = {"swap_blocks": kernels_pallas.kernel_info("tpu").get("swap_blocks", "xla")}
        compiled = traced.lower().compile()
        result["compiled"] = True
        result["error"] = None
        text = compiled.as_text()
        result["mosaic_kernels"] = text.count('custom_call_target="tpu_custom_call"')
        result["memory"] = _memory(compiled)
        result["fits_hbm"] = result["memory"].get("total_hbm", 0) <= hbm
    except Exception as e:  # noqa: BLE001 - one failed program must not stop the report
        result.update(compiled=False, error=_error_text(e), memory={}, fits_hbm=False)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    result["kernels"] = kernels
    return result


def check_engine(
    target: str,
    config: LlamaConfig,
    *,
    dtype: Any = jnp.bfloat16,
    tp: int = 1,
    ep: int = 1,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    block_size: int = 16,
    num_host_blocks: int | None = None,
    max_model_len: int | None = None,
    hbm_bytes: int | None = None,
    num_blocks: int | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    decode_steps: int | None = None,
) -> dict[str, Any]:
    """Compile every program the engine serves with, for a TPU topology.

    Args:
      target: topology name, e.g. ``"v5e:2x2"`` (its first ``tp`` chips are used).
      config: the model (see :func:`load_hf_config`).
      dtype: weights, activations and KV cache dtype.
      tp, ep, max_num_seqs, max_num_batched_tokens, block_size, max_model_len: as for
        :class:`~paxcache.engine.Engine` (``None``: the engine's defaults for a TPU).
      num_host_blocks: host swap pool (default: 4 sequences of ``max_model_len``; 0: no
        swap programs).
      hbm_bytes: HBM of one chip (default: what the TPU compiler allows a program).
      num_blocks: device KV blocks (default: the engine's own sizing for the chip's HBM).
      quantization: the layer weights' scheme (``paxcache.models.quantize.QUANTIZATIONS``).
      kv_cache_dtype: ``"auto"`` (``dtype``), ``"int8"`` or ``"fp8"`` (:mod:`paxcache.kv_quant`;
        the attention kernels read 8-bit pages, so anything else is a failure as for bf16).
      decode_steps: the multi-step decode's K (default: the engine's TPU default); > 1
        adds that program at its largest bucket.

    Returns:
      The report (JSON-ready dict): ``ok``, ``engine`` (the sizing), ``programs`` (one
      entry per compiled program), ``failures``, ``notes``.
    """
    kv_quant.check_kv_cache_dtype(kv_cache_dtype)
    devices = aot.tpu_devices(target)
    chip = devices[0].device_kind
    hbm = hbm_bytes or aot.hbm_bytes(devices[0])
    report: dict[str, Any] = {
        "target": target,
        "chip": chip,
        "num_devices": len(devices),
        "tp": tp,
        "ep": ep,
        "dtype": jnp.dtype(dtype).name,
        "quantization": quantization,
        "kv_cache_dtype": kv_cache_dtype,
        "hbm_bytes_per_chip": hbm,
        "model": {
            "model_type": config.model_type,
            "layers": config.num_hidden_layers,
            "hidden": config.hidden_size,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "vocab": config.vocab_size,
        },
        "programs": [],
        "failures": [],
        "notes": [],
    }
    model_len = int(max_model_len or config.max_position_embeddings)
    if num_host_blocks is None:
        num_host_blocks = 4 * -(-model_len // block_size)

    def build(blocks: int | None, host_blocks: int) -> AbstractEngine:
        return AbstractEngine(
            abstract_model(config, dtype, quantization),
            devices,
            hbm_bytes=hbm,
            tp=tp,
            ep=ep,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_host_blocks=host_blocks,
            max_model_len=model_len,
            num_blocks=blocks,
            kv_cache_dtype=kv_cache_dtype,
            decode_steps=decode_steps,
        )

    with aot.tpu_target(devices):
        try:
            engine = build(num_blocks, num_host_blocks)
        except Exception as e:  # noqa: BLE001 - reported, exit status non-zero
            report["failures"].append(f"engine: {_error_text(e)}")
            report["ok"] = False
            return report
        cfg = engine.cache_config
        kv_per_device = _bytes_per_device(jax.tree.leaves(engine._kv.device))
        report["engine"] = {
            "num_blocks": cfg.num_blocks,
            "block_size": cfg.block_size,
            "kv_tokens": cfg.num_blocks * cfg.block_size,
            "max_model_len": engine.max_model_len,
            "max_num_seqs": engine.max_num_seqs,
            "max_num_batched_tokens": engine.max_num_batched_tokens,
            "decode_steps": engine.decode_steps,
            "buckets": list(engine.buckets),
            "num_host_blocks": cfg.num_host_blocks,
            "weights_bytes_per_chip": engine.weights_bytes_per_device,
            "kv_cache_dtype": jnp.dtype(engine.kv_dtype).name,
            "kv_cache_bytes_per_chip": kv_per_device,
            "block_state_bytes_per_chip": _bytes_per_device(engine.block_manager.state),
            "step_reserve_bytes_per_chip": getattr(engine, "step_reserve_bytes", None),
            "step_reserve_bytes_per_block_per_chip": getattr(
                engine, "step_reserve_bytes_per_block", None
            ),
            "step_reserve_program": getattr(engine, "step_reserve_program", None),
            "sizing": (
                "num_blocks = (0.9 * (HBM - weights per chip) - step reserve) // (bytes per "
                "block per chip + step reserve per block) (paxcache.sizing)"
            ),
        }
        weights_total = sum(
            math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(nnx.state(engine.model))
        )
        report["engine"]["weights_bytes_total"] = weights_total
        for t in engine.buckets:
            args = engine._empty_step_args(t)
            report["programs"].append(
                _compile_program(f"step[T={t}]", "step", engine._jit_step, args, hbm)
            )
        decode = engine.decode_buckets
        if decode:
            # The decode-only variant at its largest bucket (the smaller ones differ only in
            # the decode kernel's grid, and each costs a whole step compile).
            t = decode[-1]
            args = engine._empty_step_args(t, decode=True)
            report["programs"].append(
                _compile_program(f"step+decode[T={t}]", "step", engine._jit_step, args, hbm)
            )
        loop = step_lib.loop_buckets(engine._shapes)
        if loop:
            # The multi-step decode at its largest bucket (decode_steps iterations under one
            # while loop: the KV cache is its carry, which must not be copied).
            t = loop[-1]
            args = engine._empty_step_args(t, decode=bool(decode), loop=True)
            name = f"step+loop{engine.decode_steps}[T={t}]"
            report["programs"].append(_compile_program(name, "step", engine._jit_step, args, hbm))
        if cfg.num_host_blocks:
            for name, fn, args in kv_cache.swap_programs(engine._kv, engine._max_swap_pairs()):
                kind = name.split("[")[0]
                report["programs"].append(_compile_program(name, kind, fn, args, hbm))
        steps = [p for p in report["programs"] if p["kind"] == "step"]
        if any(not p["fits_hbm"] for p in steps):
            _suggest_num_blocks(report, build, engine, hbm)
    for p in report["programs"]:
        if not p["compiled"]:
            report["failures"].append(f"{p['name']}: did not compile: {p['error']}")
            continue
        if not p["fits_hbm"]:
            need = p["memory"]["total_hbm"]
            report["failures"].append(
                f"{p['name']}: needs {need / _GIB:.2f} GiB per chip, {chip} has {hbm / _GIB:.2f}"
            )
        for op, impl in p["kernels"].items():
            if p["kind"] == "step" and impl != "pallas_tpu":
                report["failures"].append(f"{p['name']}: {op} runs {impl}")
    _sinks_fallback_as_note(report)
    report["ok"] = not report["failures"]
    return report


def _sinks_fallback_as_note(report: dict[str, Any]) -> None:
    """Attention with sinks (gpt-oss) runs the XLA path on a GPU target by design (the TPU
    kernels take sinks, the Mosaic GPU kernels do not): a note in the report, not a
    failure."""
    sinks = [f for f in report["failures"] if "(fallback: attention sinks" in f]
    if sinks:
        report["failures"] = [f for f in report["failures"] if f not in sinks]
        report["notes"].append(
            "ragged_paged_attention runs XLA: the model has attention sinks, which the Mosaic "
            "GPU attention kernels do not take"
        )


def _suggest_num_blocks(report: dict, build: Any, engine: AbstractEngine, hbm: int) -> None:
    """The KV cache that would fit: compile the largest bucket with a small cache, take
    what it needs besides the cache, and size the cache into the rest of the chip."""
    probe_blocks = 64
    small = build(probe_blocks, 0)
    t = small.buckets[-1]
    args = small._empty_step_args(t)
    probe = _compile_program(f"step[T={t}]", "step", small._jit_step, args, hbm)
    if not probe["compiled"]:
        report["notes"].append(
            f"even a {probe_blocks}-block KV cache does not fit: {probe['error']}"
        )
        return
    per_block = _bytes_per_device(jax.tree.leaves(small._kv.device)) / probe_blocks
    base = probe["memory"]["total_hbm"] - per_block * probe_blocks
    fit = int((hbm * 0.98 - base) // per_block)
    report["engine"]["step_bytes_besides_kv_per_chip"] = int(base)
    why = (
        f"the engine's sizing ({engine.cache_config.num_blocks} blocks, 0.9 of what the "
        f"weights leave less the measured step reserve) does not leave room for every step "
        f"({base / _GIB:.2f} GiB per chip with T={t}, weights included)"
    )
    if fit < 1:
        report["notes"].append(
            f"{why}; no KV cache fits next to them: lower --max-num-seqs / "
            "--max-num-batched-tokens, or shard over more chips (--tp)"
        )
        return
    report["engine"]["suggested_num_blocks"] = fit
    report["notes"].append(
        f"{why}; about {fit} blocks fit with 2% headroom: serve with --num-blocks {fit} "
        "(check it here with --num-blocks)"
    )


def check_kernels(target: str, *, wide: bool = False) -> dict[str, Any]:
    """Compile the kernel grid (``kernels_pallas.aot.kernel_grid``) for ``target``."""
    device = aot.tpu_devices(target)[0]
    results = [aot.compile_case(c, device) for c in aot.kernel_grid(wide)]
    failures = []
    for r in results:
        if not (r["compiled"] and r["mosaic"] and r["impl"] == "pallas_tpu"):
            why = r["error"] or f"no Mosaic kernel in the program (impl {r['impl']})"
            failures.append(f"{r['name']}: {why}")
    return {
        "target": target,
        "chip": device.device_kind,
        "kernels": results,
        "failures": failures,
        "ok": not failures,
    }


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / _GIB:.2f}"


def format_report(report: dict[str, Any]) -> str:
    """The report as a plain-text table."""
    lines = []
    if "kernels" in report:
        lines.append(f"kernel grid for {report['target']} ({report['chip']})")
        lines.append(f"{'case':72} {'ok':>3} {'secs':>6}  impl")
        for r in report["kernels"]:
            ok = "yes" if r["compiled"] and r["mosaic"] else "NO"
            lines.append(f"{r['name']:72} {ok:>3} {r['seconds']:>6.1f}  {r['impl']}")
    else:
        m, e = report["model"], report.get("engine", {})
        q = "" if report.get("quantization") is None else f", {report['quantization']}"
        if report.get("kv_cache_dtype", "auto") != "auto":
            q += f", {report['kv_cache_dtype']} KV"
        lines.append(
            f"{report['target']} ({report['chip']}, {_gib(report['hbm_bytes_per_chip'])} GiB "
            f"HBM per chip), tp={report['tp']}, ep={report.get('ep', 1)}, {report['dtype']}"
            f"{q}: {m['model_type']} "
            f"L={m['layers']} E={m['hidden']} H={m['heads']} K={m['kv_heads']} "
            f"D={m['head_dim']} V={m['vocab']}"
        )
        if e:
            lines.append(
                f"engine sizing per chip: weights {_gib(e['weights_bytes_per_chip'])} GiB, KV "
                f"cache {_gib(e['kv_cache_bytes_per_chip'])} GiB = {e['num_blocks']} blocks x "
                f"{e['block_size']} = {e['kv_tokens']} tokens, block state "
                f"{_gib(e['block_state_bytes_per_chip'])} GiB"
            )
        head = (
            f"{'program':16} {'ok':>3} {'secs':>6} {'args':>7} {'temp':>7} {'total':>7} "
            f"{'fits':>4}  kernels"
        )
        lines.append(head + "   (GiB per chip)")
        for p in report["programs"]:
            mem = p.get("memory") or {}
            kernels = ", ".join(f"{k}={v}" for k, v in p["kernels"].items()) or "-"
            lines.append(
                f"{p['name']:16} {'yes' if p['compiled'] else 'NO':>3} {p['seconds']:>6.1f} "
                f"{_gib(mem.get('argument')):>7} {_gib(mem.get('temp')):>7} "
                f"{_gib(mem.get('total_hbm')):>7} {'yes' if p['fits_hbm'] else 'NO':>4}  "
                f"{kernels}"
            )
        lines.extend(f"note: {n}" for n in report["notes"])
    lines.extend(f"FAILED: {f}" for f in report["failures"])
    lines.append("OK" if report["ok"] else f"{len(report['failures'])} failure(s)")
    return "\n".join(lines)


def to_json(report: dict[str, Any]) -> str:
    def default(x: Any) -> Any:
        if isinstance(x, (np.integer, np.floating)):
            return x.item()
        return str(x)

    return json.dumps(report, indent=2, default=default)
