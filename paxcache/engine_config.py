"""What an :class:`~paxcache.engine.Engine` is built with: one frozen :class:`EngineConfig` of
four parts (the KV cache, the scheduler, the kernels, the parallel layout) and the engine's own
options, each validated where it is made.

``Engine(model, tokenizer, config)`` takes it; ``Engine(model, tokenizer, **kwargs)`` and
``Engine.from_pretrained(path, **kwargs)`` take the same options as flat keywords (vLLM's
``EngineArgs`` names) and build it with :meth:`EngineConfig.from_kwargs`. ``None`` means "by
backend" (batch limits, ``decode_steps``, ``num_blocks``) or "the model's"
(``max_model_len``); :meth:`EngineConfig.resolve` fills those in for the platform the engine's
programs run on, and the engine keeps the resolved config as ``engine.config``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from paxcache import compile_cache, decode_loop, kv_quant
from paxcache import step as step_lib

__all__ = ["EngineConfig", "KVCacheConfig", "KernelConfig", "ParallelConfig", "SchedulerConfig"]


def _positive_int(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    """The paged KV cache.

    Attributes:
      num_blocks: device KV blocks; None: enough for ``max_num_seqs`` full-length sequences,
        capped by ``kv_memory_bytes`` (or 1 GiB on CPU); on an accelerator 90% of the free
        memory less the largest step's own needs (:mod:`paxcache.sizing`).
      block_size: tokens per block.
      num_host_blocks: host (pinned memory) blocks for swap preemption.
      kv_cache_dtype: ``"auto"`` (the model's dtype), ``"int8"``, ``"fp8"`` (:mod:`.kv_quant`).
      enable_prefix_caching: reuse computed blocks of identical prompt prefixes.
      kv_memory_bytes: KV cache budget in bytes (instead of ``num_blocks``).
      watermark: fraction of blocks kept free at admission.
    """

    num_blocks: int | None = None
    block_size: int = 16
    num_host_blocks: int = 0
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    kv_memory_bytes: int | None = None
    watermark: float = 0.01

    def __post_init__(self) -> None:
        _positive_int("num_blocks", self.num_blocks, allow_none=True)
        _positive_int("block_size", self.block_size)
        _positive_int("num_host_blocks", self.num_host_blocks, minimum=0)
        _positive_int("kv_memory_bytes", self.kv_memory_bytes, allow_none=True)
        kv_quant.check_kv_cache_dtype(self.kv_cache_dtype)
        _bool("enable_prefix_caching", self.enable_prefix_caching)
        w = self.watermark
        if isinstance(w, bool) or not isinstance(w, (int, float)) or math.isnan(w):
            raise ValueError(f"watermark must be a float in [0, 1), got {w!r}")
        if not 0.0 <= w < 1.0:
            raise ValueError(f"watermark must be a float in [0, 1), got {w!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: what one step holds and how sequences are preempted.

    Attributes:
      max_num_seqs: most sequences running (and rows in one step); None: by backend
        (:func:`paxcache.step.default_batch_limits`: 64 on CPU, 256 on TPU/GPU).
      max_num_batched_tokens: token budget of one step (decodes + prefill chunks); None: by
        backend (256 on CPU, 2048 on TPU/GPU).
      max_model_len: longest sequence (prompt + output); None: the model's
        ``max_position_embeddings``.
      preemption_mode: ``"swap"`` (needs ``num_host_blocks > 0``) or ``"recompute"``.
      policy: ``"fifo"`` or ``"prefill_first"``.
      decode_steps: K, the most decode iterations one device program runs when a step holds
        only decode rows (:mod:`paxcache.decode_loop`); None: by backend (1 on CPU, 8 on
        TPU/GPU); 1 is the single-step engine.
      async_scheduling: dispatch a step that needs no host decision before reading the one
        before it (:mod:`paxcache.overlap`); False: every step is read before the next.
    """

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    preemption_mode: str = "recompute"
    policy: str = "fifo"
    decode_steps: int | None = None
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "decode_steps"):
            _positive_int(name, getattr(self, name), allow_none=True)
        if self.preemption_mode not in ("swap", "recompute"):
            raise ValueError(
                f"preemption_mode must be 'swap' or 'recompute': {self.preemption_mode!r}"
            )
        if self.policy not in ("fifo", "prefill_first"):
            raise ValueError(f"policy must be 'fifo' or 'prefill_first', got {self.policy!r}")
        _bool("async_scheduling", self.async_scheduling)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which implementation runs every op of the step.

    Attributes:
      impl: ``"auto"`` (Pallas on TPU/GPU, XLA on CPU), ``"reference"``, ``"xla"``,
        ``"pallas"``, ``"pallas_tpu"``, ``"pallas_gpu"`` (:mod:`kernels_pallas`). Swaps
        between device and host memory always run the memory-kinds program (a Mosaic kernel
        cannot address host memory), so they follow ``impl`` only for ``"reference"``.
      interpret: run Pallas kernels in interpret mode (CPU tests).
    """

    impl: str = "auto"
    interpret: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.impl, str):
            raise ValueError(f"impl must be a str, got {self.impl!r}")
        _bool("interpret", self.interpret)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The device mesh (:mod:`paxcache.sharding`).

    Attributes:
      tp: tensor-parallel degree (mesh axis ``tp``: attention heads and MLP columns).
      ep: expert-parallel degree (mesh axis ``ep``, MoE models).
    """

    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        _positive_int("tp", self.tp)
        _positive_int("ep", self.ep)

    @property
    def num_devices(self) -> int:
        return self.tp * self.ep


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built with besides its model and tokenizer.

    Attributes:
      cache, scheduler, kernel, parallel: the four parts (see each).
      model_name: the name reported by ``stats`` and the server.
      seed: seed for requests that do not set one.
      compile_cache: JAX's persistent compilation cache (process-wide,
        :mod:`paxcache.compile_cache`): None (the directory JAX already has, else
        ``$XDG_CACHE_HOME/paxcache/jax``), a path, or False (left as it is).
      warmup: compile every program serving can run at the first ``step`` (False: each when
        first needed, or call ``Engine.warmup`` yourself).
      freeze_gc: at the end of ``Engine.warmup``, move every object alive then (the
        imports', the compiled programs' and their caches', the model's: ~0.6M for the tiny
        model) to Python's permanent GC generation (``gc.freeze``, as vLLM and SGLang do after
        warm-up), so a full collection while serving scans only what serving made: one took
        0.7 s of a 5 s run of many short requests on the tiny model. Those objects are never
        collected as cycles afterwards (they live as long as the process anyway).
    """

    cache: KVCacheConfig = dataclasses.field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    kernel: KernelConfig = dataclasses.field(default_factory=KernelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    model_name: str = "model"
    seed: int | None = None
    compile_cache: str | os.PathLike[str] | bool | None = None
    warmup: bool = True
    freeze_gc: bool = True

    def __post_init__(self) -> None:
        parts = (
            ("cache", KVCacheConfig),
            ("scheduler", SchedulerConfig),
            ("kernel", KernelConfig),
            ("parallel", ParallelConfig),
        )
        for name, cls in parts:
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"EngineConfig.{name} must be a {cls.__name__}")
        if not isinstance(self.model_name, str):
            raise ValueError(f"model_name must be a str, got {self.model_name!r}")
        _positive_int("seed", self.seed, allow_none=True, minimum=0)
        compile_cache.resolve(self.compile_cache)  # raises on a value of the wrong kind
        _bool("warmup", self.warmup)
        _bool("freeze_gc", self.freeze_gc)
        if self.scheduler.preemption_mode == "swap" and self.cache.num_host_blocks <= 0:
            raise ValueError("preemption_mode='swap' needs num_host_blocks > 0")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """The config of flat keyword options (each part's field names, and the engine's own:
        ``model_name``, ``seed``, ``compile_cache``, ``warmup``, ``freeze_gc``).

        Raises:
          TypeError: a keyword that is no option (the message names it).
          ValueError: a value out of its range (the message names the option).
        """
        parts: dict[str, dict[str, Any]] = {name: {} for name in _PART_FIELDS}
        own: dict[str, Any] = {}
        for key, value in kwargs.items():
            part = _FIELD_PART.get(key)
            if part is not None:
                parts[part][key] = value
            elif key in _OWN_FIELDS:
                own[key] = value
            else:
                raise TypeError(f"unknown engine option {key!r}")
        built = {name: _PART_TYPES[name](**values) for name, values in parts.items()}
        return cls(**built, **own)

    def to_kwargs(self) -> dict[str, Any]:
        """The flat keyword options this config was (or could have been) made from."""
        out = {f: getattr(self, f) for f in _OWN_FIELDS}
        for name in _PART_FIELDS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out

    def resolve(self, backend: str, model_max_len: int) -> EngineConfig:
        """This config with the by-backend and by-model defaults filled in.

        Args:
          backend: the platform the engine's programs run on (``"cpu"``, ``"tpu"``, ``"gpu"``).
          model_max_len: the model's ``max_position_embeddings``.

        Raises:
          ValueError: ``max_model_len`` above ``model_max_len``.
        """
        s = self.scheduler
        seqs, tokens = step_lib.resolve_batch_limits(
            backend, s.max_num_seqs, s.max_num_batched_tokens
        )
        max_model_len = model_max_len if s.max_model_len is None else s.max_model_len
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings {model_max_len}"
            )
        scheduler = dataclasses.replace(
            s,
            max_num_seqs=seqs,
            max_num_batched_tokens=tokens,
            max_model_len=max_model_len,
            decode_steps=decode_loop.resolve_decode_steps(s.decode_steps, backend),
        )
        return dataclasses.replace(self, scheduler=scheduler)


_PART_TYPES = {
    "cache": KVCacheConfig,
    "scheduler": SchedulerConfig,
    "kernel": KernelConfig,
    "parallel": ParallelConfig,
}
_PART_FIELDS = {name: [f.name for f in dataclasses.fields(t)] for name, t in _PART_TYPES.items()}
_FIELD_PART = {f: name for name, fields in _PART_FIELDS.items() for f in fields}
_OWN_FIELDS = ("model_name", "seed", "compile_cache", "warmup", "freeze_gc")
