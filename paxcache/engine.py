"""The continuous-batching engine: one fused, jit-compiled device step per scheduling round.

Each :meth:`Engine.step`:

1. the host :class:`~paxcache.scheduler.Scheduler` picks which sequences run and how many
   tokens each feeds (decodes, prefill chunks, resumed and newly admitted sequences), within
   ``max_num_batched_tokens`` and ``max_num_seqs``, preempting when blocks run short;
2. one compiled device function (per token-count bucket) runs, on the device and without
   returning to Python in between: the allocator's batched ``append`` → copy-on-write block
   copies → attention metadata → model forward (K/V writes + ragged paged attention in every
   layer, under ``lax.scan``) → sampling → prefix-cache ``commit``. The ``BlockState`` and the
   ``KVCache`` are donated and stay on the device; the host gets back only the sampled tokens
   (and their log-probabilities), per-row ok flags and the free-block count;
3. the host appends the tokens, detokenizes, applies stop conditions and frees finished
   sequences.

Token counts are padded to power-of-two buckets (and the batch to ``max_num_seqs`` rows), so
the step compiles once per bucket; :meth:`Engine.warmup` compiles them all up front and
``stats()["num_compilations"]`` counts every trace, so a warmed-up engine provably never
compiles again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels_pallas
from paxcache import allocator, kv_cache
from paxcache import compile_cache as compile_cache_lib
from paxcache.attention import metadata_from_state, paged_attention_op
from paxcache.config import CacheConfig
from paxcache.errors import DuplicateSequenceError, SequenceTooLongError
from paxcache.outputs import INTERNAL_ERROR, CompletionOutput, RequestOutput
from paxcache.sampling import SamplingParams, request_keys, sample
from paxcache.scheduler import Scheduler, SeqState
from paxcache.scheduler import Sequence as Seq

__all__ = ["Engine", "RequestOutput", "CompletionOutput"]

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # top log-probabilities computed every step (static shape)

_SALT_GC_THRESHOLD = 4096  # cache-salt map size that triggers dropping unused salts


# Every XLA backend compilation in this process, counted through JAX's monitoring events (so
# a cache miss that re-lowers a cached trace counts too, not only retraces).
_BACKEND_COMPILES = [0]


def _on_event(event: str, duration: float, **kwargs: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _BACKEND_COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def _token_buckets(max_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    buckets = []
    b = min(smallest, max_tokens)
    while b < max_tokens:
        buckets.append(b)
        b *= 2
    buckets.append(max_tokens)
    return tuple(buckets)


# Default (max_num_seqs, max_num_batched_tokens) by backend, chosen like vLLM's (which picks
# them by hardware and usage): enough rows and tokens per step to keep the device busy, few
# enough that the largest step stays short (decode latency for everyone waits on it) and the
# warm-up compiles few buckets.
# * TPU / GPU: vLLM's OpenAI-server defaults on most GPUs (256 sequences, 2048 tokens).
# * CPU: a matmul over few rows is bound by reading the weights, so a decode step of 64 rows
#   costs little more than one of 32 and halves the steps of a busy batch (1.6x the
#   throughput on the workload of scripts/bench_peer.py); a 256-token step already runs the
#   matmuls at full speed, while 1024 tokens made the XLA attention path (which gathers
#   each token row's context) the bottleneck: 3x slower (bench/results/step_profile_*.md).
DEFAULT_BATCH_LIMITS = {"cpu": (64, 256)}
DEFAULT_BATCH_LIMITS_ACCELERATOR = (256, 2048)


def default_batch_limits(backend: str) -> tuple[int, int]:
    """``(max_num_seqs, max_num_batched_tokens)`` the engine uses on ``backend`` by default."""
    return DEFAULT_BATCH_LIMITS.get(backend, DEFAULT_BATCH_LIMITS_ACCELERATOR)


class _StepFailed(Exception):
    """The device step raised (the cause is chained); ``failed``: requests already failed."""

    def __init__(self, failed: dict[str, Any]) -> None:
        super().__init__("engine step failed")
        self.failed = failed


class _Request:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        seqs: list[Seq],
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_ids
        self.params = params
        self.seqs = seqs
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.aborted = False
        self.num_cached_tokens: int | None = None  # prompt tokens hit at first admission
        # output_kind="delta": tokens / logprobs of each completion already reported.
        self.sent_tokens = [0] * len(seqs)
        self.sent_logprobs = [0] * len(seqs)


class Engine:
    """A paged-KV LLM engine with continuous batching (vLLM-style API).

    Args:
      model: a :class:`~paxcache.models.LlamaForCausalLM` (or any NNX module with the same
        ``forward_paged`` / ``config`` interface).
      tokenizer: its tokenizer (``encode``, ``decode``, ``eos_token_id``).
      model_name: the name reported by ``stats`` and the server.
      num_blocks: device KV blocks; default: enough for ``max_num_seqs`` full-length
        sequences, capped by ``kv_memory_bytes`` (or 1 GiB on CPU, 90% of free memory on
        accelerators).
      block_size: tokens per block.
      max_num_seqs: most sequences running (and rows in one step); default by backend
        (``default_batch_limits``: 64 on CPU, 256 on TPU/GPU).
      max_num_batched_tokens: token budget of one step (decodes + prefill chunks); default
        by backend (256 on CPU, 2048 on TPU/GPU).
      num_host_blocks: host (pinned memory) blocks for swap preemption.
      enable_prefix_caching: reuse computed blocks of identical prompt prefixes.
      preemption_mode: ``"swap"`` (needs host blocks) or ``"recompute"``.
      policy: scheduling policy, ``"fifo"`` or ``"prefill_first"``.
      tp: tensor-parallel degree (shards KV heads and weights over a ``tp`` mesh axis).
      max_model_len: longest sequence (prompt + output); default the model's
        ``max_position_embeddings``.
      kv_memory_bytes: KV cache budget in bytes (alternative to ``num_blocks``).
      watermark: fraction of blocks kept free at admission.
      impl: kernel implementation (``"auto"``: Pallas on TPU/GPU, XLA on CPU).
      seed: seed for requests that do not set one.
      compile_cache: JAX's persistent compilation cache (process-wide, see
        :mod:`paxcache.compile_cache`): ``None`` (default) uses the directory JAX already
        has, else ``$XDG_CACHE_HOME/paxcache/jax`` (``~/.cache/paxcache/jax``); a path uses
        that directory; ``False`` leaves the cache as it is (off unless JAX was told
        otherwise).
      warmup: compile every step bucket on first use (the first :meth:`step`), logging one
        line per bucket, so no later step compiles; ``False`` compiles each bucket when a
        step first needs it (or call :meth:`warmup` yourself).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_name: str = "model",
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        policy: str = "fifo",
        tp: int = 1,
        max_model_len: int | None = None,
        kv_memory_bytes: int | None = None,
        watermark: float = 0.01,
        impl: str = "auto",
        interpret: bool = False,
        seed: int | None = None,
        compile_cache: str | os.PathLike[str] | bool | None = None,
        warmup: bool = True,
    ) -> None:
        cfg = model.config
        cache_dir = compile_cache_lib.resolve(compile_cache)  # validates before any work
        backend_defaults = default_batch_limits(self._target_backend())
        if max_num_seqs is None:
            max_num_seqs = backend_defaults[0]
        if max_num_batched_tokens is None:
            max_num_batched_tokens = backend_defaults[1]
        if preemption_mode not in ("swap", "recompute"):
            raise ValueError(
                f"preemption_mode must be 'swap' or 'recompute', got {preemption_mode!r}"
            )
        if preemption_mode == "swap" and num_host_blocks <= 0:
            raise ValueError("preemption_mode='swap' needs num_host_blocks > 0")
        for name, val in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("block_size", block_size),
            ("tp", tp),
        ):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        windows = set(cfg.layer_windows())
        if len(windows) > 1:
            raise ValueError(
                "layers with different sliding windows are not supported by the paged engine "
                f"(got {sorted(windows, key=str)})"
            )
        self.sliding_window = next(iter(windows))
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.impl = impl
        self.interpret = interpret
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.tp = tp
        self._rng = np.random.default_rng(seed)
        self.compile_cache_dir = None if cache_dir is None else compile_cache_lib.enable(cache_dir)
        self._auto_warmup = bool(warmup)
        self._warmed_up = False

        model_max = int(getattr(cfg, "max_position_embeddings", 2048))
        self.max_model_len = int(max_model_len or model_max)
        if self.max_model_len > model_max:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {model_max}"
            )
        max_blocks_per_seq = -(-self.max_model_len // block_size)
        kv_dtype = model.dtype
        kv_heads = max(cfg.num_key_value_heads, tp)  # tp > K: kv heads replicated (sharding.py)
        bytes_per_block = (
            2
            * cfg.num_hidden_layers
            * kv_heads
            * block_size
            * cfg.head_dim
            * jnp.dtype(kv_dtype).itemsize
        )
        if num_blocks is None:
            if kv_memory_bytes is None and self._on_accelerator():
                num_blocks, _ = kv_cache.num_blocks_for_budget(
                    0.9,
                    cfg.num_hidden_layers,
                    kv_heads // tp,  # per device
                    cfg.head_dim,
                    block_size,
                    kv_dtype,
                    memory_stats=self._memory_stats(),
                )
            else:
                budget = kv_memory_bytes if kv_memory_bytes is not None else 1 << 30
                num_blocks = min(max_num_seqs * max_blocks_per_seq, budget // bytes_per_block)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        # Swapped sequences keep their slot while parked on the host, so swap mode gets a
        # second bank of slots; running sequences never exceed max_num_seqs.
        num_slots = max_num_seqs * (2 if num_host_blocks > 0 else 1)
        self.cache_config = CacheConfig(
            num_blocks=int(num_blocks),
            block_size=block_size,
            max_seqs=num_slots,
            max_blocks_per_seq=max_blocks_per_seq,
            num_host_blocks=num_host_blocks,
            watermark=watermark,
            enable_prefix_caching=enable_prefix_caching,
            sliding_window=self.sliding_window,
        )
        self.bytes_per_block = bytes_per_block
        self.buckets = _token_buckets(max_num_batched_tokens)
        self._graphdef, self._params = nnx.split(model)
        self.mesh, self._params = self._place_params(model, self._params, tp)
        self._kv_spec = dict(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=kv_heads,
            head_dim=cfg.head_dim,
            num_blocks=int(num_blocks),
            block_size=block_size,
            dtype=kv_dtype,
            num_host_blocks=num_host_blocks,
        )
        self._state, self._kv = self._new_device_state()
        self._num_traces = 0
        self._compiles_at_start = _BACKEND_COMPILES[0]
        self._cache_hits_at_start = compile_cache_lib.cache_hits()
        self._jit_step = jax.jit(self._step_impl, donate_argnums=(0, 1))
        self._jit_allocate = jax.jit(self._count(allocator.allocate), static_argnames=("commit",))
        self._jit_fork = jax.jit(self._count(allocator.fork))
        self._jit_free = jax.jit(self._count(allocator.free))
        self._jit_swap_out = jax.jit(self._count(allocator.swap_out))
        self._jit_swap_in = jax.jit(self._count(allocator.swap_in))
        self._jit_num_free = jax.jit(self._count(allocator.num_free_blocks))
        self._jit_num_free_host = jax.jit(self._count(allocator.num_free_host_blocks))
        self._jit_prefix_counters = jax.jit(
            self._count(lambda st: (st.prefix_queries, st.prefix_hits))
        )

        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._computed = np.zeros(num_slots, np.int32)  # host mirror for commit
        self._num_free_cache: int | None = None
        self._salts: dict[Any, int] = {None: 0}  # cache_salt -> allocator salt id (never reused)
        self._next_salt = 1
        self._salt_gc_at = _SALT_GC_THRESHOLD
        self._requests: dict[str, _Request] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._failed: list[Seq] = []
        self._num_generated = 0
        self._swapped_out_seqs = self._swapped_out_blocks = 0
        self._swapped_in_seqs = self._swapped_in_blocks = 0
        self._jit_check = None  # allocator.check_invariants, compiled on first use
        self._num_refused_rows = 0  # planned rows the allocator refused (never, unless a bug)
        self._num_prompt_tokens = 0  # prompt tokens of admitted requests
        self._num_prefill_computed = 0  # prompt tokens actually run through the model
        self._eos_ids = set(getattr(cfg, "eos_token_ids", ()) or ())
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self._eos_ids.add(int(tokenizer.eos_token_id))
        self.scheduler = Scheduler(
            self,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode=preemption_mode,
            policy=policy,
            on_finish=self._on_scheduler_finish,
        )
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB on %s), max_num_seqs %d, "
            "max_num_batched_tokens %d, max_model_len %d, step buckets %s",
            self.cache_config.num_blocks,
            block_size,
            self.bytes_per_block * self.cache_config.num_blocks / 2**20,
            jax.default_backend(),
            max_num_seqs,
            max_num_batched_tokens,
            self.max_model_len,
            list(self.buckets),
        )

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(
        cls,
        model: str = "tiny",
        *,
        dtype: Any = jnp.float32,
        **kwargs: Any,
    ) -> Engine:
        """Loads ``"tiny"`` (the bundled model) or an HF-format directory and builds an engine.

        Keyword arguments are those of :class:`Engine` (``num_blocks``, ``block_size``,
        ``max_num_seqs``, ``max_num_batched_tokens``, ``num_host_blocks``,
        ``enable_prefix_caching``, ``preemption_mode``, ``tp``, ...).
        """
        from paxcache.models import load_pretrained

        t0 = time.perf_counter()
        m, tok = load_pretrained(model, dtype=dtype)
        name = "tiny" if str(model) == "tiny" else str(model).rstrip("/").split("/")[-1]
        logger.info(
            "loaded %s (%s, %d layers, %s) in %.1fs",
            name,
            m.config.model_type,
            m.config.num_hidden_layers,
            jnp.dtype(dtype).name,
            time.perf_counter() - t0,
        )
        return cls(m, tok, model_name=name, **kwargs)

    # Placement hooks: where the weights, block state and KV cache live. scripts/compile_check.py
    # overrides them to build the same engine from abstract values on a TPU topology.

    def _target_backend(self) -> str:
        """The platform the engine's programs run on (batch-limit defaults, KV sizing)."""
        return jax.default_backend()

    def _on_accelerator(self) -> bool:
        """Whether the default KV sizing takes a fraction of free accelerator memory."""
        return self._target_backend() != "cpu"

    def _memory_stats(self) -> dict[str, int] | None:
        """Memory stats the KV sizing uses (None: the first device's ``memory_stats()``)."""
        return None

    def _place_params(self, model: Any, params: Any, tp: int) -> tuple[Any, Any]:
        """``(mesh, params)``: no mesh for ``tp == 1``, else sharded over a ``tp`` mesh."""
        if tp == 1:
            return None, params
        from paxcache import sharding

        return sharding.setup_tensor_parallel(model, params, tp)

    def _init_state(self) -> allocator.BlockState:
        """The empty block state, committed to the device like every later (jit-produced)
        state, so the first step after warm-up hits the same compiled executable."""
        state = allocator.init(self.cache_config)
        if self.mesh is None:
            return jax.device_put(state, jax.devices()[0])
        from paxcache import sharding

        # Replicated on every tp device (every host's, see sharding.place).
        return sharding.place(state, sharding.replicated(self.mesh))

    def _new_device_state(self) -> tuple[allocator.BlockState, kv_cache.KVCache]:
        """A fresh (empty) block state and KV cache, placed as the step expects (start-up,
        and recovery after a failed step consumed the donated buffers)."""
        return self._init_state(), self._create_kv(**self._kv_spec)

    def _create_kv(self, **dims: Any) -> kv_cache.KVCache:
        """The KV cache (split over kv heads on the ``tp`` mesh)."""
        if self.mesh is None:
            return kv_cache.KVCache.create(**dims)
        from paxcache import sharding

        return kv_cache.KVCache.create(**dims, sharding=sharding.kv_sharding(self.mesh))

    def _device_kv(self) -> kv_cache.KVCache:
        """The cache the fused step takes: device pages only. The host pool stays out of the
        step (passed through it, XLA:TPU refuses the program: "HostOffloadOutputLocation
        Mismatch"); :meth:`_with_host_pool` puts it back on the step's result."""
        return self._kv.replace(host_k=None, host_v=None)

    def _with_host_pool(self, kv: kv_cache.KVCache) -> kv_cache.KVCache:
        return kv.replace(host_k=self._kv.host_k, host_v=self._kv.host_v)

    def _max_swap_pairs(self) -> int:
        """Most blocks one swap moves: one sequence's blocks (the scheduler swaps one at a
        time), at most the host pool."""
        return min(self.cache_config.max_blocks_per_seq, self.num_host_blocks)

    def _count(self, fn):
        def counted(*args, **kwargs):
            self._num_traces += 1  # runs only while tracing
            return fn(*args, **kwargs)

        counted.__name__ = getattr(fn, "__name__", "fn")
        return counted

    # ------------------------------------------------------------------ device step

    def _step_impl(
        self,
        state,
        kv,
        params,
        tokens,
        slot_ids,
        q_lens,
        kv_lens,
        num_seqs,
        append_counts,
        append_tokens,
        computed,
        sample_rows,
        temperature,
        top_k,
        top_p,
        min_p,
        keys,
        *,
        fuse_allocator: bool = True,
    ):
        """The fused step. Shapes: tokens i32[T]; slot_ids/q_lens/kv_lens i32[R];
        append_counts/computed i32[B]; append_tokens i32[B, 1]; sample_rows i32[R];
        sampling arrays [R]; keys u32[R, 2]. R = max_num_seqs, B = allocator slots.

        ``fuse_allocator=False`` (benchmarks only) skips ``append``/copies/``commit`` and
        reads the block tables as they are: the same step fed a precomputed block table."""
        self._num_traces += 1  # trace-time only: counts traces
        t = tokens.shape[0]
        live = jnp.arange(slot_ids.shape[0]) < num_seqs
        if fuse_allocator:
            state, app = allocator.append(state, append_counts, append_tokens, commit=False)
            kv = kv_cache.apply_copies(kv, app.copy_src, app.copy_dst, mesh=self.mesh)
            row_ok = app.ok[slot_ids] & live  # bool[R]
        else:
            row_ok = live
        md = metadata_from_state(state, slot_ids, q_lens, num_seqs, t, kv_lens)
        md = md.replace(slot_mapping=jnp.where(row_ok[md.row_seq], md.slot_mapping, -1))
        model = nnx.merge(self._graphdef, params)
        window = self.sliding_window

        def attn_fn(layer, q, k, v, k_pages, v_pages):
            out, (k_pages, v_pages) = paged_attention_op(
                q,
                k,
                v,
                k_pages,
                v_pages,
                md,
                layer=layer,
                sliding_window=window,
                impl=self.impl,
                interpret=self.interpret,
                mesh=self.mesh,
            )
            return out, k_pages, v_pages

        logits, (k_pages, v_pages) = model.forward_paged(
            tokens, md.positions, (kv.k, kv.v), attn_fn, logits_indices=sample_rows
        )
        kv = kv.replace(k=k_pages, v=v_pages)
        out = sample(logits, temperature, top_k, top_p, min_p, keys, num_logprobs=MAX_LOGPROBS)
        b = computed.shape[0]
        idx = jnp.where(row_ok, slot_ids, b)
        computed = computed.at[idx].set(kv_lens, mode="drop")
        if fuse_allocator:
            state = allocator.commit(state, computed)
        return state, kv, out, row_ok, allocator.num_free_blocks(state)

    # ------------------------------------------------------------------ CacheOps (scheduler)

    @property
    def block_size(self) -> int:
        return self.cache_config.block_size

    @property
    def num_host_blocks(self) -> int:
        return self.cache_config.num_host_blocks

    def num_free_blocks(self) -> int:
        if self._num_free_cache is None:
            self._num_free_cache = int(self._jit_num_free(self._state))
        return self._num_free_cache

    def num_free_host_blocks(self) -> int:
        return int(self._jit_num_free_host(self._state))

    def free_slots(self) -> int:
        return len(self._free_slots)

    def blocks_held(self, seq: Seq) -> int:
        return -(-seq.num_allocated // self.block_size)

    def _changed(self) -> None:
        self._num_free_cache = None

    def admit(self, seqs: list[Seq], reserve: int = 0) -> bool:
        """Allocates a unit's history in a free slot and forks its followers from it.

        Refused (nothing changes) unless ``reserve`` blocks plus the watermark stay free.
        """
        lead = seqs[0]
        slot = self._free_slots[-1]
        n = len(lead.token_ids)
        padded = np.zeros(self.cache_config.max_model_len, np.int32)
        padded[:n] = lead.token_ids
        new_state, res = self._jit_allocate(
            self._state, np.int32(slot), padded, np.int32(n), np.int32(lead.salt), commit=False
        )
        if not bool(res.ok):
            return False
        # The allocator already keeps the watermark free; the reserve comes on top of it.
        if reserve > 0 and int(self._jit_num_free(new_state)) < (
            reserve + self.cache_config.watermark_blocks
        ):
            return False
        self._free_slots.pop()
        cached = int(res.num_cached_tokens)
        req = self._requests.get(lead.request_id)
        if req is not None and req.num_cached_tokens is None:
            req.num_cached_tokens = cached
        lead.slot, lead.num_computed, lead.num_allocated = slot, cached, n
        lead.shared_last = len(seqs) > 1
        for f in seqs[1:]:
            child = self._free_slots.pop()
            new_state, fres = self._jit_fork(new_state, np.int32(slot), np.int32(child))
            assert bool(fres.ok), "fork into a free slot cannot fail"
            f.slot, f.num_computed, f.num_allocated = child, cached, n
            f.shared_last = True
            self._computed[child] = cached
        self._state = new_state
        self._computed[slot] = cached
        self._changed()
        return True

    def release(self, seq: Seq) -> None:
        if seq.slot < 0:
            return
        mask = np.zeros(self.cache_config.max_seqs, bool)
        mask[seq.slot] = True
        self._state = self._jit_free(self._state, mask)
        self._computed[seq.slot] = 0
        self._free_slots.append(seq.slot)
        seq.slot = -1
        self._changed()

    def swap_out(self, seq: Seq) -> bool:
        """Moves every block of ``seq`` to the host pool (all or nothing)."""
        mask = np.zeros(self.cache_config.max_seqs, bool)
        mask[seq.slot] = True
        new_state, plan = self._jit_swap_out(self._state, mask)
        if not bool(np.asarray(plan.ok)[seq.slot]):  # host read: no eager-gather compile
            return False
        self._kv = kv_cache.swap_out(self._kv, plan.src, plan.dst, plan.num)
        self._state = new_state
        self._swapped_out_seqs += 1
        self._swapped_out_blocks += int(plan.num)
        self._changed()
        return True

    def swap_in(self, seq: Seq, reserve: int = 0) -> bool:
        """Moves ``seq`` back to device blocks; refused (nothing changes) unless ``reserve``
        blocks plus the watermark stay free."""
        mask = np.zeros(self.cache_config.max_seqs, bool)
        mask[seq.slot] = True
        new_state, plan = self._jit_swap_in(self._state, mask)
        if not bool(np.asarray(plan.ok)[seq.slot]):  # host read: no eager-gather compile
            return False
        num = int(plan.num)
        if self.num_free_blocks() - num < reserve + self.cache_config.watermark_blocks:
            return False
        self._kv = kv_cache.swap_in(self._kv, plan.src, plan.dst, plan.num)
        self._state = new_state
        self._swapped_in_seqs += 1
        self._swapped_in_blocks += num
        self._changed()
        return True

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: Any = None,
    ) -> None:
        """Queues a request.

        Args:
          request_id: unique id (a duplicate of a live request raises
            :class:`~paxcache.errors.DuplicateSequenceError`).
          prompt: text (tokenized with the engine's tokenizer) or token ids.
          params: sampling parameters (default greedy, 64 tokens).
          cache_salt: optional tenant key (any hashable, e.g. a string); prefix-cache blocks
            are shared only between requests with equal salts (see the README's prefix-cache
            threat model).

        Raises:
          SequenceTooLongError: the prompt leaves no room to generate within
            ``max_model_len``, or needs more blocks than the cache can ever admit.
          ValueError: empty prompt or token ids outside the vocabulary.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise DuplicateSequenceError(f"request id {request_id!r} is already running")
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = list(self.tokenizer.encode(prompt))
        else:
            text = None
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise SequenceTooLongError(
                f"prompt of {len(ids)} tokens leaves no room to generate: max_model_len is "
                f"{self.max_model_len}"
            )
        cfg = self.cache_config
        need = cfg.blocks_for(len(ids) + 1)
        if need > cfg.num_blocks - cfg.watermark_blocks:
            raise SequenceTooLongError(
                f"prompt of {len(ids)} tokens needs {need} KV blocks but the cache can admit at "
                f"most {cfg.num_blocks - cfg.watermark_blocks}"
            )
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        salt = self._salt_id(cache_salt)
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**62))
        seqs = [
            Seq(
                request_id=request_id,
                index=j,
                token_ids=list(ids),
                num_prompt=len(ids),
                params=params,
                seed=seed,
                salt=salt,
            )
            for j in range(params.n)
        ]
        for s in seqs:
            s.logprobs = [] if params.logprobs is not None else None
            s.decoder = _make_decoder(self.tokenizer)
        lead = seqs[0]
        lead.followers = seqs[1:]
        for f in seqs[1:]:
            f.leader = lead
            f.arrival = lead.arrival
        self._requests[request_id] = _Request(request_id, text, list(ids), params, seqs)
        self._num_prompt_tokens += len(ids)
        self.scheduler.add(seqs)

    def _salt_id(self, cache_salt: Any) -> int:
        """The allocator's int32 salt for a ``cache_salt``: exact (a dict, never a hash) and
        never reused, so two salts never share blocks. Entries whose id no block or live
        sequence carries any more are dropped now and then, so the map stays bounded."""
        try:
            sid = self._salts.get(cache_salt)
        except TypeError:
            raise ValueError(
                f"cache_salt must be hashable, got {type(cache_salt).__name__}"
            ) from None
        if sid is not None:
            return sid
        if len(self._salts) >= self._salt_gc_at:
            in_use = set(np.asarray(self._state.block_salt).tolist())
            in_use.update(s.salt for r in self._requests.values() for s in r.seqs)
            self._salts = {k: v for k, v in self._salts.items() if k is None or v in in_use}
            self._salt_gc_at = max(_SALT_GC_THRESHOLD, 2 * len(self._salts))
        if self._next_salt > np.iinfo(np.int32).max:
            raise ValueError("cache salt ids are exhausted (2**31 distinct salts); restart")
        sid = self._salts[cache_salt] = self._next_salt
        self._next_salt += 1
        return sid

    def abort(self, request_id: str) -> None:
        """Stops a request now and frees its blocks; unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.remove(req.seqs)
        for s in req.seqs:
            self.release(s)
            if not s.is_finished:
                s.state = SeqState.FINISHED
                s.finish_reason = "abort"
        req.aborted = True
        self._pending_outputs.append(self._output(req, finished=True))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def _on_scheduler_finish(self, seq: Seq) -> None:
        self.release(seq)
        self._failed.append(seq)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling round and device step.

        Returns:
          One :class:`RequestOutput` per request that progressed (or finished) in this step,
          with cumulative ``token_ids``/``text`` and this step's deltas in
          ``new_token_ids``/``new_text``.
        """
        if self._auto_warmup and not self._warmed_up:
            logger.info("first step: warming up %d step shapes first", len(self.buckets))
            self.warmup()
        outputs, self._pending_outputs = self._pending_outputs, []
        plan = self.scheduler.schedule()
        touched: dict[str, _Request] = {}
        # Sequences the scheduler had to fail (they cannot fit) report now.
        for seq in self._failed:
            if seq.request_id in self._requests:
                touched[seq.request_id] = self._requests[seq.request_id]
        self._failed = []
        if plan.rows:
            try:
                self._run(plan, touched)
            except _StepFailed as e:
                self._recover(plan, touched, e)
        for req in touched.values():
            finished = all(s.is_finished for s in req.seqs)
            outputs.append(self._output(req, finished=finished))
            if finished:
                self._requests.pop(req.request_id, None)
        for req in touched.values():
            for s in req.seqs:
                s.new_ids = []
        return outputs

    def _run(self, plan, touched: dict[str, _Request]) -> None:
        r = self.max_num_seqs
        b = self.cache_config.max_seqs
        total = plan.num_tokens
        t = next(x for x in self.buckets if x >= total)
        tokens = np.zeros(t, np.int32)
        slot_ids = np.zeros(r, np.int32)
        q_lens = np.zeros(r, np.int32)
        kv_lens = np.zeros(r, np.int32)
        append_counts = np.zeros(b, np.int32)
        append_tokens = np.zeros((b, 1), np.int32)
        off = 0
        row_end = []
        for i, (seq, q) in enumerate(plan.rows):
            c = seq.num_computed
            tokens[off : off + q] = seq.token_ids[c : c + q]
            off += q
            row_end.append(off - 1)
            slot_ids[i], q_lens[i], kv_lens[i] = seq.slot, q, c + q
            extra = c + q - seq.num_allocated
            if extra > 0:
                assert extra == 1, "at most one new token per step beyond the allocation"
                append_counts[seq.slot] = 1
                append_tokens[seq.slot, 0] = seq.token_ids[seq.num_allocated]
        sample_rows = np.zeros(r, np.int32)
        seeds = np.zeros(r, np.uint64)
        steps = np.zeros(r, np.int64)
        index = np.zeros(r, np.int64)
        temperature = np.zeros(r, np.float32)
        top_k = np.zeros(r, np.int32)
        top_p = np.ones(r, np.float32)
        min_p = np.zeros(r, np.float32)
        vocab = self.model.config.vocab_size
        failed: dict[str, _Request] = {}  # requests whose host work raised: only they fail
        for j, (seq, row) in enumerate(plan.samples):
            sample_rows[j] = row_end[row]
            try:
                p = seq.params
                seeds[j], steps[j], index[j] = seq.seed & (2**64 - 1), seq.num_generated, seq.index
                temperature[j], top_k[j] = p.temperature, min(p.top_k, vocab)
                top_p[j], min_p[j] = p.top_p, p.min_p
            except Exception:  # noqa: BLE001 - this request fails, the batch runs
                temperature[j], top_k[j], top_p[j], min_p[j] = 0.0, 0, 1.0, 0.0
                self._isolate(seq, failed, "preparing its sampling inputs")
        keys = request_keys(seeds, steps, index)
        try:
            # Committed only once the results are on the host: a failure that surfaces at the
            # transfer leaves self._state / self._kv as the (donated) inputs, which _recover
            # then sees are gone.
            state, kv, out, row_ok, num_free = self._jit_step(
                self._state,
                self._device_kv(),
                self._params,
                tokens,
                slot_ids,
                q_lens,
                kv_lens,
                np.int32(len(plan.rows)),
                append_counts,
                append_tokens,
                self._computed.copy(),
                sample_rows,
                temperature,
                top_k,
                top_p,
                min_p,
                keys,
            )
            toks = np.asarray(out.tokens)
            row_ok = np.asarray(row_ok)
            num_free = int(num_free)
            need_lp = any(s.params.logprobs is not None for s, _ in plan.samples)
            if need_lp:
                lps = np.asarray(out.logprob)
                top_ids = np.asarray(out.top_ids)
                top_lps = np.asarray(out.top_logprobs)
        except Exception as e:  # noqa: BLE001 - handled by step(): fails this step's requests
            raise _StepFailed(failed) from e
        self._state, self._kv, self._num_free_cache = state, self._with_host_pool(kv), num_free
        refused = len(plan.rows) - int(row_ok[: len(plan.rows)].sum())
        if refused:
            # The scheduler plans only rows whose blocks are free, so this is a bug in its block
            # arithmetic; those rows simply run again next step (check_invariants reports it).
            self._num_refused_rows += refused
            logger.warning("the allocator refused %d of %d planned rows", refused, len(plan.rows))
        # Advance the rows that ran.
        for i, (seq, q) in enumerate(plan.rows):
            if not row_ok[i] or seq.request_id in failed:
                continue
            self._num_prefill_computed += max(
                0, min(seq.num_prompt, seq.num_computed + q) - seq.num_computed
            )
            seq.num_computed += q
            if seq.num_computed > seq.num_allocated:
                seq.num_allocated = seq.num_computed
                seq.shared_last = False
            self._computed[seq.slot] = seq.num_computed
        finished: list[Seq] = []
        now = time.monotonic()
        for j, (seq, row) in enumerate(plan.samples):
            if not row_ok[row] or seq.request_id in failed:
                continue
            lead = plan.rows[row][0]
            if seq is not lead:  # a follower samples from its leader's last row
                seq.token_ids = lead.token_ids[: lead.num_computed]
                seq.num_computed = lead.num_computed
                seq.num_allocated = lead.num_allocated
                seq.leader = None
                seq.shared_last = True
                self._computed[seq.slot] = seq.num_computed
            tok = int(toks[j])
            seq.token_ids.append(tok)
            seq.new_ids.append(tok)
            self._num_generated += 1
            req = self._requests[seq.request_id]
            if req.first_token_time is None:
                req.first_token_time = now
            try:
                if seq.logprobs is not None:
                    k = seq.params.logprobs
                    seq.logprobs.append(
                        {
                            "token_id": tok,
                            "logprob": float(lps[j]),
                            "top": [(int(top_ids[j, i]), float(top_lps[j, i])) for i in range(k)],
                        }
                    )
                self._check_stop(seq, tok)  # detokenizes
            except Exception:  # noqa: BLE001 - this request fails, the others go on
                self._isolate(seq, failed, "detokenizing or checking stop conditions")
                continue
            touched[seq.request_id] = req
            if seq.is_finished:
                finished.append(seq)
        for seq in finished:
            if seq.request_id not in failed:
                self.scheduler.remove([seq])
                self.release(seq)
        for req in failed.values():
            self._fail_request(req, INTERNAL_ERROR)
            touched[req.request_id] = req

    def _isolate(self, seq: Seq, failed: dict[str, _Request], doing: str) -> None:
        """Marks ``seq``'s request failed (logged with the traceback); ``_run`` skips it."""
        req = self._requests.get(seq.request_id)
        if req is not None and seq.request_id not in failed:
            logger.exception("request %s failed while %s; failing it alone", seq.request_id, doing)
            failed[seq.request_id] = req

    def _fail_request(self, req: _Request, message: str) -> None:
        """Finishes every completion of ``req`` with ``"error"`` and frees its blocks."""
        self.scheduler.remove(req.seqs)
        for s in req.seqs:
            self.release(s)
            if not s.is_finished:
                s.state = SeqState.FINISHED
                s.finish_reason = "error"
                s.error = message

    def _recover(self, plan: Any, touched: dict[str, _Request], err: _StepFailed) -> None:
        """After the device step raised: fails the requests of that step only. If the step had
        already consumed (donated) the cache, the cache is rebuilt empty and every request
        holding blocks fails too (their KV is gone); queued requests are unaffected."""
        cause = err.__cause__
        logger.error(
            "engine step failed (%s: %s); failing the %d requests in it",
            type(cause).__name__,
            cause,
            len({s.request_id for s, _ in plan.rows}),
            exc_info=cause,
        )
        victims = {s.request_id for s, _ in plan.rows} | {s.request_id for s, _ in plan.samples}
        victims |= set(err.failed)
        leaves = jax.tree.leaves((self._state, self._kv))
        if any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
            logger.error("the step consumed the KV cache; rebuilding it empty")
            for req in self._requests.values():
                if any(s.slot >= 0 for s in req.seqs):
                    victims.add(req.request_id)
                    for s in req.seqs:
                        s.slot = -1  # the old state is gone: nothing to free
            self._state, self._kv = self._new_device_state()
            self._free_slots = list(range(self.cache_config.max_seqs - 1, -1, -1))
            self._computed[:] = 0
            self._num_free_cache = None
        for rid in victims:
            req = self._requests.get(rid)
            if req is not None:
                self._fail_request(req, INTERNAL_ERROR)
                touched[rid] = req

    def _check_stop(self, seq: Seq, tok: int) -> None:
        p = seq.params
        is_eos = tok in self._eos_ids and not p.ignore_eos
        is_stop_tok = tok in (p.stop_token_ids or ())
        if not (is_eos or is_stop_tok):
            seq.text += seq.decoder.push(tok)
        reason = None
        stops = p.stop or ()
        if stops:
            window_start = max(0, seq.emitted - max(len(s) for s in stops))
            hits = [(seq.text.find(s, window_start), s) for s in stops]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, _ = min(hits)
                seq.text = seq.text[:i]
                reason = "stop"
        if reason is None:
            if is_eos or is_stop_tok:
                reason = "stop"
            elif seq.num_generated >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
                reason = "length"
        if reason is not None:
            seq.state = SeqState.FINISHED
            seq.finish_reason = reason
            if reason == "length" and not stops:
                seq.text += seq.decoder.flush()

    def _output(self, req: _Request, *, finished: bool) -> RequestOutput:
        comps = []
        stops = req.params.stop or ()
        hold = max((len(s) for s in stops), default=1) - 1
        delta = req.params.output_kind == "delta"
        for i, s in enumerate(req.seqs):
            visible = len(s.text) if s.is_finished else max(s.emitted, len(s.text) - hold)
            new_text = s.text[s.emitted : visible]
            s.emitted = visible
            if delta:  # only what is new: linear in the output length, however long
                start = s.num_prompt + req.sent_tokens[i]
                token_ids = s.token_ids[start:] if s.num_generated > 0 else []
                req.sent_tokens[i] += len(token_ids)
                logprobs = None
                if s.logprobs is not None:
                    logprobs = s.logprobs[req.sent_logprobs[i] :]
                    req.sent_logprobs[i] = len(s.logprobs)
                text = new_text
            else:
                token_ids = list(s.token_ids[s.num_prompt :]) if s.num_generated > 0 else []
                logprobs = list(s.logprobs) if s.logprobs is not None else None
                text = s.text[:visible]
            comps.append(
                CompletionOutput(
                    index=s.index,
                    token_ids=token_ids,
                    text=text,
                    finish_reason=s.finish_reason,
                    logprobs=logprobs,
                    new_token_ids=list(s.new_ids),
                    new_text=new_text,
                )
            )
        error = next((s.error for s in req.seqs if s.error), None)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=comps,
            finished=finished,
            error=error,
            num_cached_tokens=req.num_cached_tokens,
            num_preemptions=sum(s.num_preemptions for s in req.seqs),
        )

    # ------------------------------------------------------------------ conveniences

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs prompts to completion; results come back in input order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = []
        for p, sp in zip(prompts, params, strict=True):
            rid = f"gen-{next(_gen_ids)}"
            self.add_request(rid, p, sp)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while wanted - final.keys():
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yields one request's outputs step by step (other queued requests progress too)."""
        rid = f"stream-{next(_gen_ids)}"
        self.add_request(rid, prompt, params)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def _empty_step_args(self, t: int) -> tuple:
        """Arguments of a step with T=t that runs nothing (warm-up, HLO inspection)."""
        r, b = self.max_num_seqs, self.cache_config.max_seqs
        z = np.zeros
        return (
            self._state,
            self._device_kv(),
            self._params,
            z(t, np.int32),
            z(r, np.int32),
            z(r, np.int32),
            z(r, np.int32),
            np.int32(0),
            z(b, np.int32),
            z((b, 1), np.int32),
            self._computed.copy(),
            z(r, np.int32),
            z(r, np.float32),
            z(r, np.int32),
            np.ones(r, np.float32),
            z(r, np.float32),
            z((r, 2), np.uint32),
        )

    def warmup(self) -> None:
        """Compiles every program serving can run, so serving never compiles.

        Every token bucket of the fused step, the allocator functions and, with a host pool,
        every swap program (out and in, every pair bucket). A Mosaic TPU kernel that fails to
        compile is replaced by the XLA path here, with one warning naming the op and the
        error (``stats()["kernel_impls"]`` then says ``"xla (fallback: ...)"``).

        Logs one line per compiled step bucket (``logging`` INFO, logger ``paxcache.engine``)
        and a summary. With the persistent compile cache (see :mod:`paxcache.compile_cache`)
        a restart loads the executables instead of compiling them. :meth:`step` calls this
        on first use unless the engine was built with ``warmup=False``.
        """
        t0 = time.perf_counter()
        hits0 = compile_cache_lib.cache_hits()
        compiles0 = self._num_compiled()
        b = self.cache_config.max_seqs
        z = np.zeros
        # A TPU kernel Mosaic rejects falls back to XLA here (one warning), not at serving.
        with kernels_pallas.compile_probes():
            for i, t in enumerate(self.buckets):
                tb = time.perf_counter()
                hb = compile_cache_lib.cache_hits()
                self._state, kv, out, _, _ = self._jit_step(*self._empty_step_args(t))
                self._kv = self._with_host_pool(kv)
                jax.block_until_ready(out.tokens)
                logger.info(
                    "warm-up %d/%d: step for %d tokens ready in %.1fs%s",
                    i + 1,
                    len(self.buckets),
                    t,
                    time.perf_counter() - tb,
                    " (compile cache)" if compile_cache_lib.cache_hits() > hb else "",
                )
        # Refused / empty calls compile the allocator functions without changing the state.
        padded = z(self.cache_config.max_model_len, np.int32)
        self._jit_allocate(
            self._state, np.int32(-1), padded, np.int32(1), np.int32(0), commit=False
        )
        self._jit_fork(self._state, np.int32(-1), np.int32(-1))
        self._jit_free(self._state, z(b, bool))
        if self.num_host_blocks > 0:
            self._jit_swap_out(self._state, z(b, bool))
            self._jit_swap_in(self._state, z(b, bool))
            # Every swap program (both directions, every pair bucket): no compile at the
            # first preemption.
            self._kv = kv_cache.warmup_swaps(self._kv, self._max_swap_pairs())
        self.stats()
        self._warmed_up = True
        logger.info(
            "warm-up done in %.1fs: %d compiled, %d loaded from the compile cache%s",
            time.perf_counter() - t0,
            self._num_compiled() - compiles0,
            compile_cache_lib.cache_hits() - hits0,
            f" ({self.compile_cache_dir})" if self.compile_cache_dir else " (cache off)",
        )

    def _num_compiled(self) -> int:
        """XLA compilations in this process since the engine was made. JAX's compile event
        also fires for executables loaded from the persistent cache; those are not counted
        here (they are ``num_compile_cache_hits``)."""
        events = _BACKEND_COMPILES[0] - self._compiles_at_start
        return events - (compile_cache_lib.cache_hits() - self._cache_hits_at_start)

    def stats(self) -> dict[str, Any]:
        """Counters and gauges; cheap enough to poll every second.

        Besides the block, prefix-cache and compilation figures: ``num_preemptions`` (units
        preempted) split into ``num_preemptions_swap`` and ``num_preemptions_recompute``;
        ``num_swaps`` (sequences swapped out); ``num_swapped_out_seqs`` /
        ``num_swapped_out_blocks`` and ``num_swapped_in_seqs`` / ``num_swapped_in_blocks``
        (sequences and blocks moved each way); ``num_running`` / ``num_waiting`` /
        ``num_swapped`` (sequences); ``oldest_waiting_age_s``: seconds since the oldest request
        that has a sequence queued (waiting or swapped) arrived, 0 when none is queued.
        """
        st = self._state
        total = self.cache_config.num_blocks
        free = self.num_free_blocks()
        queries, hits = (int(x) for x in self._jit_prefix_counters(st))
        sched = self.scheduler
        return {
            "num_total_blocks": total,
            "num_free_blocks": free,
            "kv_usage": 1.0 - free / total,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "num_preemptions": sched.num_preemptions,
            "num_preemptions_swap": sched.num_preemptions_swap,
            "num_preemptions_recompute": sched.num_preemptions_recompute,
            "num_swaps": sched.num_swaps,
            "num_swapped_out_seqs": self._swapped_out_seqs,
            "num_swapped_out_blocks": self._swapped_out_blocks,
            "num_swapped_in_seqs": self._swapped_in_seqs,
            "num_swapped_in_blocks": self._swapped_in_blocks,
            "oldest_waiting_age_s": self._oldest_waiting_age(),
            "num_compilations": self._num_compiled(),
            "num_compile_cache_hits": compile_cache_lib.cache_hits() - self._cache_hits_at_start,
            "num_traces": self._num_traces,
            "num_running": len(self.scheduler.running),
            "num_waiting": self.scheduler.num_waiting,
            "num_swapped": len(self.scheduler.swapped),
            "num_generated_tokens": self._num_generated,
            "num_prompt_tokens": self._num_prompt_tokens,
            "num_prefill_tokens_computed": self._num_prefill_computed,
            "num_free_host_blocks": self.num_free_host_blocks(),
            "num_total_host_blocks": self.num_host_blocks,
            "block_size": self.block_size,
            "bytes_per_block": self.bytes_per_block,
            "kv_cache_bytes": self.bytes_per_block * total,
            "device": ", ".join(str(d) for d in jax.devices()[: max(1, self.tp)]),
            "kernel_impls": kernels_pallas.kernel_info(),
            "max_model_len": self.max_model_len,
        }

    def _oldest_waiting_age(self) -> float:
        sched = self.scheduler
        queued = [u[0] for u in sched.waiting] + sched.swapped
        arrivals = [
            self._requests[s.request_id].arrival_time
            for s in queued
            if s.request_id in self._requests
        ]
        return max(0.0, time.monotonic() - min(arrivals)) if arrivals else 0.0

    def check_invariants(self) -> dict[str, bool]:
        """Named consistency checks of the whole cache state; all True when consistent.

        For tests and debugging (the stress suite calls it after every step); it reads the
        allocator state back from the device, and its first call compiles one function.
        Checks: the allocator's own (``allocator.check_invariants`` on the engine's
        ``BlockState``, prefixed ``allocator.``) and the host-side accounting around it:
        every live sequence in exactly one queue with the matching state; queues in age order
        and every running sequence older than every queued one; at most ``max_num_seqs``
        running; slots (free list, live sequences and the allocator's active / swapped flags
        agree); each live sequence's length and computed count match its slot; the cached
        free-block count; every row the scheduler planned so far got its blocks from the
        allocator; and, with no request alive, every device and host block free.
        """
        if self._jit_check is None:
            self._jit_check = jax.jit(allocator.check_invariants)
        checks = {f"allocator.{k}": bool(v) for k, v in self._jit_check(self._state).items()}
        cfg = self.cache_config
        sched = self.scheduler
        st = jax.device_get(
            {
                "seq_lens": self._state.seq_lens,
                "active": self._state.active,
                "swapped": self._state.swapped,
                "free": allocator.num_free_blocks(self._state),
                "host_free": allocator.num_free_host_blocks(self._state),
            }
        )
        waiting = [s for unit in sched.waiting for s in unit]
        queued = waiting + sched.swapped
        live = sched.running + queued
        ids = [id(s) for s in live]
        checks["queues_disjoint"] = len(set(ids)) == len(ids)
        checks["queue_states"] = (
            all(s.state == SeqState.RUNNING for s in sched.running)
            and all(s.state == SeqState.SWAPPED for s in sched.swapped)
            and all(s.state == SeqState.WAITING for s in waiting)
        )
        unfinished = [s for r in self._requests.values() for s in r.seqs if not s.is_finished]
        checks["requests_accounted"] = sorted(map(id, unfinished)) == sorted(ids)
        ages = [u[0].age for u in sched.waiting]
        swapped_ages = [s.age for s in sched.swapped]
        checks["queues_in_age_order"] = ages == sorted(ages) and swapped_ages == sorted(
            swapped_ages
        )
        checks["running_older_than_queued"] = not (sched.running and queued) or max(
            s.age for s in sched.running
        ) < min(s.age for s in queued)
        checks["running_within_max_num_seqs"] = len(sched.running) <= self.max_num_seqs
        checks["followers_with_running_leader"] = all(
            s.leader.state == SeqState.RUNNING for s in sched.running if s.leader is not None
        )
        holders = sched.running + sched.swapped
        slots = [s.slot for s in holders]
        free_slots = list(self._free_slots)
        checks["slots_accounted"] = (
            all(0 <= x < cfg.max_seqs for x in slots)
            and all(s.slot == -1 for s in waiting)
            and len(set(slots)) == len(slots)
            and len(set(free_slots)) == len(free_slots)
            and sorted(slots + free_slots) == list(range(cfg.max_seqs))
        )
        swapped_ids = {id(s) for s in sched.swapped}
        checks["slot_flags_match"] = checks["slots_accounted"] and (
            all(bool(st["active"][s.slot]) for s in holders)
            and not any(bool(st["active"][x]) for x in free_slots)
            and all(bool(st["swapped"][s.slot]) == (id(s) in swapped_ids) for s in holders)
        )
        checks["lengths_match"] = checks["slots_accounted"] and (
            all(int(st["seq_lens"][s.slot]) == s.num_allocated for s in holders)
            and all(s.num_computed <= s.num_allocated <= len(s.token_ids) for s in holders)
            and all(s.num_computed == s.num_allocated == 0 for s in waiting)
            and all(int(self._computed[s.slot]) == s.num_computed for s in holders)
            and not any(int(self._computed[x]) for x in free_slots)
        )
        checks["free_count_cached"] = self._num_free_cache in (None, int(st["free"]))
        checks["planned_rows_ran"] = self._num_refused_rows == 0
        checks["idle_frees_everything"] = bool(self._requests) or (
            int(st["free"]) == cfg.num_blocks
            and int(st["host_free"]) == cfg.num_host_blocks
            and not st["active"].any()
        )
        return checks


def _make_decoder(tokenizer: Any) -> Any:
    from paxcache.models.tokenizer import IncrementalDecoder

    return IncrementalDecoder(tokenizer)


def _counter() -> Iterator[int]:
    i = 0
    while True:
        yield i
        i += 1


_gen_ids = _counter()
