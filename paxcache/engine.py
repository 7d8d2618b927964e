"""The continuous-batching engine: one scheduling round and one fused device step per call.

:meth:`Engine.step`: :meth:`Scheduler.schedule <paxcache.scheduler.Scheduler.schedule>`
returns a :class:`~paxcache.scheduler.StepPlan` (rows, samples, and the admissions,
preemptions and swaps that made room); the engine runs the plan's KV swaps
(:mod:`paxcache.kv_cache`), builds :class:`~paxcache.step.StepInputs` and runs one compiled
program, :func:`paxcache.step.step` (allocator ``append`` → copy-on-write → the model's paged
forward → sampling → prefix ``commit``, state and cache donated; a decode-only plan may run
up to ``decode_steps`` iterations in it, :mod:`paxcache.decode_loop`); then
:meth:`Scheduler.postprocess <paxcache.scheduler.Scheduler.postprocess>` does the
per-sequence accounting and the engine returns :class:`RequestOutput` objects (ARCHITECTURE.md,
"One token's trip").

Token counts are padded to power-of-two buckets (and the batch to ``max_num_seqs`` rows), so
the step compiles once per bucket; :meth:`Engine.warmup` compiles them all up front and
``stats()["num_compilations"]`` counts every compilation.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels_pallas
from paxcache import allocator, decode_loop, grammar, kv_cache, kv_quant, overlap, packing, sizing
from paxcache import compile_cache as compile_cache_lib
from paxcache import step as step_lib
from paxcache.config import CacheConfig
from paxcache.engine_config import EngineConfig
from paxcache.errors import DuplicateSequenceError
from paxcache.manager import BlockManager
from paxcache.models import quantize
from paxcache.models.layer_plan import shared_window
from paxcache.models.tokenizer import IncrementalDecoder
from paxcache.outputs import (
    INTERNAL_ERROR,
    CompletionOutput,
    OutputProcessor,
    RequestOutput,
    RequestState,
)
from paxcache.overlap import StepFailed
from paxcache.placement import Placement
from paxcache.sampling import SamplingParams
from paxcache.scheduler import Scheduler, StepPlan, StepResult
from paxcache.sequence import Sequence as Seq
from paxcache.sequence import check_prompt, new_request
from paxcache.step import default_batch_limits

__all__ = ["CompletionOutput", "Engine", "RequestOutput", "default_batch_limits"]

logger = logging.getLogger(__name__)

PROBE_BLOCKS = 64
"""KV blocks of the small cache the sizing probe compiles the largest step over
(:meth:`Engine._size_for_device`)."""
SIZING_CHECKS = 3
"""Compiles over the sized cache (then bisected sizes), at most, before the sizing falls back
to the largest cache the programs compiled over (:meth:`Engine._size_for_device`)."""


class Engine:
    """A paged-KV LLM engine with continuous batching (vLLM-style API).

    Args:
      model: a :class:`~paxcache.models.LlamaForCausalLM`, or any NNX module with the same
        ``config`` / ``dtype`` / ``forward_paged(token_ids, kv_cache, metadata,
        logits_indices)`` interface whose attention is :class:`paxcache.nn.PagedAttention`.
        The engine's kernel choice and mesh reach that layer through the step's
        :class:`~paxcache.attention.AttentionMetadata`.
      tokenizer: its tokenizer (``encode``, ``decode``, ``eos_token_id``).
      config: an :class:`~paxcache.engine_config.EngineConfig` (its parts: the KV cache, the
        scheduler, the kernels, the parallel layout).
      **options: instead of ``config``, its options as flat keywords
        (:meth:`EngineConfig.from_kwargs <paxcache.engine_config.EngineConfig.from_kwargs>`:
        ``num_blocks``, ``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``,
        ``num_host_blocks``, ``kv_cache_dtype``, ``enable_prefix_caching``,
        ``preemption_mode``, ``policy``, ``tp``, ``ep``, ``max_model_len``,
        ``kv_memory_bytes``, ``watermark``, ``impl``, ``interpret``, ``seed``,
        ``compile_cache``, ``warmup``, ``decode_steps``, ``async_scheduling``, ``model_name``).
      placement: where the weights, block state and KV cache live and whose defaults the
        engine takes (:class:`~paxcache.placement.Placement`, the live devices, by default;
        :mod:`paxcache.compile_check` passes abstract ones).

    ``engine.config`` is the config with the by-backend defaults resolved and ``num_blocks``
    as sized; the attributes
    ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``decode_steps``,
    ``impl``, ``tp``, ``ep`` are its values.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EngineConfig | None = None,
        *,
        placement: Placement | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise TypeError(f"give either config or keyword options, not both: {sorted(options)}")
        config = EngineConfig.from_kwargs(**options) if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.placement = where = Placement() if placement is None else placement
        cfg = model.config
        model_max = int(getattr(cfg, "max_position_embeddings", 2048))
        self.config = config = config.resolve(where.backend(), model_max)
        kv_opts, sched, par = config.cache, config.scheduler, config.parallel
        self.impl, self.interpret = config.kernel.impl, config.kernel.interpret
        kv_dtype = kv_quant.resolve_kv_dtype(kv_opts.kv_cache_dtype, model.dtype, self.impl)
        cache_dir = compile_cache_lib.resolve(config.compile_cache)
        # The allocator frees blocks behind a window only when every layer has that window.
        self.sliding_window = shared_window(cfg.layer_windows())
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = config.model_name
        self.max_num_seqs = max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.max_model_len = sched.max_model_len
        self.tp, self.ep, self.kv_dtype = par.tp, par.ep, kv_dtype
        self._rng = np.random.default_rng(config.seed)
        self.compile_cache_dir = None if cache_dir is None else compile_cache_lib.enable(cache_dir)
        self._auto_warmup = config.warmup
        self.decode_steps = sched.decode_steps
        self.async_scheduling = sched.async_scheduling
        self._pipeline = overlap.Pipeline(self) if sched.async_scheduling else None
        self._warmed_up = False

        block_size = kv_opts.block_size
        max_blocks_per_seq = -(-self.max_model_len // block_size)
        kv_heads = max(cfg.num_key_value_heads, self.tp)  # tp > K: replicated (sharding.py)
        self.bytes_per_block = kv_cache.bytes_per_block(
            cfg.num_hidden_layers, kv_heads, cfg.head_dim, block_size, kv_dtype, where.backend()
        )
        self.buckets = step_lib.token_buckets(self.max_num_batched_tokens)
        decode = step_lib.wants_decode_variant(self.impl, where.backend())
        rope_switch = getattr(cfg, "rope_switch_len", None)  # longrope: see Scheduler R7
        self._shapes = step_lib.StepShapes(
            self.buckets,
            max_num_seqs,
            cfg.vocab_size,
            decode,
            self.decode_steps,
            rope_lens=rope_switch is not None,
        )
        self.decode_buckets = step_lib.decode_buckets(self._shapes)  # () off TPU kernels
        graphdef, params = nnx.split(model)
        self.mesh, self._params = where.place_params(model, params, self.tp, self.ep)
        self._step_config = step_lib.StepConfig(
            graphdef=graphdef, impl=self.impl, interpret=self.interpret, mesh=self.mesh
        )
        self._swap_impl = "reference" if self.impl == "reference" else "auto"
        # An 8-bit cache's per-layer scales ({} for a float one, or where nothing runs).
        self.kv_scales = kv_quant.calibrate_engine(self, kv_heads, block_size) if where.runs else {}
        self._num_traces = 0
        self._compiles_at_start = compile_cache_lib.backend_compiles()
        self._cache_hits_at_start = compile_cache_lib.cache_hits()
        self._jit_step = step_lib.jitted_step(self._step_config)  # shared by equal configs
        eos_ids = set(getattr(cfg, "eos_token_ids", ()) or ())
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos_ids.add(int(tokenizer.eos_token_id))
        self._grammars = grammar.GrammarCompiler(tokenizer, cfg.vocab_size, eos_ids)  # lazy
        self.warmup_structured = self.warmup_prompt_logprobs = False  # see warmup()
        build = functools.partial(
            self._build_cache,
            block_size=block_size,
            max_blocks_per_seq=max_blocks_per_seq,
            num_host_blocks=kv_opts.num_host_blocks,
            watermark=kv_opts.watermark,
            enable_prefix_caching=kv_opts.enable_prefix_caching,
            kv_heads=kv_heads,
            scheduler_args=dict(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                preemption_mode=sched.preemption_mode,
                policy=sched.policy,
                max_model_len=self.max_model_len,
                eos_token_ids=eos_ids,
                rope_switch_len=rope_switch,
            ),
        )
        num_blocks = kv_opts.num_blocks
        if num_blocks is None and kv_opts.kv_memory_bytes is None and where.on_accelerator():
            num_blocks = self._size_for_device(build, kv_heads)
        elif num_blocks is None:
            num_blocks = sizing.host_num_blocks(
                kv_opts.kv_memory_bytes, max_num_seqs, max_blocks_per_seq, self.bytes_per_block
            )
        if num_blocks < 1:  # an explicit value is checked by KVCacheConfig
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        build(int(num_blocks))
        cache_opts = dataclasses.replace(kv_opts, num_blocks=int(num_blocks))  # as sized
        self.config = dataclasses.replace(config, cache=cache_opts)
        if num_blocks * block_size < self.max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, less than max_model_len %d: longer requests "
                "are refused (shard over more devices, or lower max_model_len)",
                num_blocks * block_size,
                self.max_model_len,
            )
        self.outputs = OutputProcessor()  # live requests and their outputs
        n, mib = self.cache_config.num_blocks, self.bytes_per_block * num_blocks / 2**20
        limits = (max_num_seqs, self.max_num_batched_tokens, self.max_model_len, list(self.buckets))
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB on %s), max_num_seqs %d, "
            "max_num_batched_tokens %d, max_model_len %d, step buckets %s",
            *(n, block_size, mib, jax.default_backend(), *limits),
        )

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(
        cls,
        model: str = "tiny",
        *,
        dtype: Any = None,
        quantization: str | None = None,
        config: EngineConfig | None = None,
        **options: Any,
    ) -> Engine:
        """Loads ``"tiny"`` or an HF-format directory (``dtype`` None: bf16 on TPU/GPU, f32 on CPU).

        ``quantization`` (None, ``"int8"``, ``"int8-w8a8"``, ``"fp8"``) is
        :func:`paxcache.models.load_pretrained`'s; ``config`` or the flat ``options``
        (``num_blocks``, ``block_size``, ``max_num_seqs``, ``tp``, ``ep``, ...) are
        :class:`Engine`'s, validated before the weights load; ``model_name`` defaults to the
        directory's name.
        """
        from paxcache.models import load_pretrained

        if config is not None and options:
            raise TypeError(f"give either config or keyword options, not both: {sorted(options)}")
        name = "tiny" if str(model) == "tiny" else str(model).rstrip("/").split("/")[-1]
        options.setdefault("model_name", name)
        config = EngineConfig.from_kwargs(**options) if config is None else config
        t0 = time.perf_counter()
        dtype = step_lib.default_dtype() if dtype is None else dtype
        tp, ep = config.parallel.tp, config.parallel.ep
        m, tok = load_pretrained(model, dtype=dtype, tp=tp, ep=ep, quantization=quantization)
        what = f"{m.config.model_type}, {m.config.num_hidden_layers} layers, {quantize.describe(m)}"
        logger.info("loaded %s (%s) in %.1fs", config.model_name, what, time.perf_counter() - t0)
        return cls(m, tok, config)

    def _new_device_state(self) -> tuple[allocator.BlockState, kv_cache.KVCache]:
        """A fresh (empty) block state and KV cache, placed as the step expects (start-up,
        and recovery after a failed step consumed the donated buffers)."""
        where = self.placement
        return where.init_state(self.cache_config, self.mesh), where.create_kv(
            self.mesh, **self._kv_spec
        )

    def _device_kv(self) -> kv_cache.KVCache:
        """The cache the fused step takes: device pages only. The host pool stays out of the
        step (passed through it, XLA:TPU refuses the program: "HostOffloadOutputLocation
        Mismatch"); :meth:`_with_host_pool` puts it back on the step's result."""
        return self._kv.replace(host=None)

    def _with_host_pool(self, kv: kv_cache.KVCache) -> kv_cache.KVCache:  # see _device_kv
        return kv.replace(host=self._kv.host)

    def _max_swap_pairs(self) -> int:
        """Most blocks one swap program moves (a plan's pairs are moved in chunks of this):
        one sequence's blocks, at most the host pool."""
        return min(self.cache_config.max_blocks_per_seq, self.num_host_blocks)

    def _on_trace(self, inputs: step_lib.StepInputs) -> None:
        """A call of this engine traced a new step program (see :func:`step.tracing_for`)."""
        self._num_traces += 1
        step_lib.log_first_use(inputs, self._warmed_up)

    def _build_cache(
        self, num_blocks: int, *, kv_heads: int, scheduler_args: dict, **cache: Any
    ) -> None:
        """The cache configuration, block state, KV cache and scheduler for ``num_blocks``
        (swap mode: a second bank of slots, for sequences parked on the host)."""
        max_num_seqs = scheduler_args["max_num_seqs"]
        self.cache_config = CacheConfig(
            num_blocks=num_blocks,
            max_seqs=max_num_seqs * (2 if cache["num_host_blocks"] > 0 else 1),
            sliding_window=self.sliding_window,
            **cache,
        )
        cfg = self.model.config
        self._kv_spec = dict(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=kv_heads,
            head_dim=cfg.head_dim,
            num_blocks=num_blocks,
            block_size=cache["block_size"],
            dtype=self.kv_dtype,
            num_host_blocks=cache["num_host_blocks"],
            **self.kv_scales,
        )
        self._kv = None  # the old cache's buffers go before the new one is made
        state, self._kv = self._new_device_state()
        self.scheduler = Scheduler(BlockManager(self.cache_config, state=state), **scheduler_args)

    def _size_for_device(self, build: Any, kv_heads: int) -> int:
        """Device KV blocks on an accelerator (see :mod:`paxcache.sizing`).

        The programs whose temporaries are the largest (the largest token bucket's step and,
        with ``decode_steps > 1``, the largest multi-step decode loop) are compiled over
        caches of the sizes :func:`sizing.settle_num_blocks` asks for (:data:`PROBE_BLOCKS`
        blocks first); the cache gets the fewest blocks any of them allows.
        """
        device = jax.devices()[0]
        stats = self.placement.memory_stats() or sizing.device_memory_stats(device)  # pre-probe
        cfg = self.model.config
        largest = self.buckets[-1]
        programs: dict[str, tuple[int, dict[str, bool]]] = {f"step[T={largest}]": (largest, {})}
        loops = step_lib.loop_buckets(self._shapes)
        if loops:  # the loop carries the weights and the cache: its temporaries differ
            decode = bool(step_lib.decode_buckets(self._shapes))
            name = f"step+loop{self.decode_steps}[T={loops[-1]}]"
            programs[name] = (loops[-1], dict(decode=decode, loop=True))

        def reserves_over(num_blocks: int, *, may_not_fit: bool = False) -> dict | None:
            """Each program's reserve over ``num_blocks`` blocks; None when the compiler
            refuses one for memory and ``may_not_fit``."""
            build(num_blocks)
            out = {}
            for name, (t, flags) in programs.items():
                try:
                    with step_lib.tracing_for(self._on_trace):
                        args = self._empty_step_args(t, **flags)
                        out[name] = sizing.probe_reserve(self._jit_step, args)
                except Exception as e:  # noqa: BLE001 - only an out-of-memory refusal is expected
                    if may_not_fit and "RESOURCE_EXHAUSTED" in str(e):
                        return None
                    raise
            return out

        dims = dict(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads_per_device=kv_heads // self.tp,
            head_dim=cfg.head_dim,
            block_size=build.keywords["block_size"],
            dtype=self.kv_dtype,
        )
        sized = sizing.settle_num_blocks(
            reserves_over, stats, dims, bytes_per_block=self.bytes_per_block // self.tp,
            probe_blocks=PROBE_BLOCKS, max_checks=SIZING_CHECKS,
        )  # fmt: skip
        self.step_reserve_bytes = sized.reserve_bytes
        self.step_reserve_bytes_per_block = sized.reserve_bytes_per_block
        self.step_reserve_program = sized.program
        num_blocks = sized.num_blocks
        return num_blocks

    # ------------------------------------------------------------------ views

    @property
    def block_manager(self) -> BlockManager:
        """The scheduler's block manager (the one owner of the block state)."""
        return self.scheduler.block_manager

    @property
    def block_size(self) -> int:
        return self.cache_config.block_size

    @property
    def num_host_blocks(self) -> int:
        return self.cache_config.num_host_blocks

    def free_slots(self) -> int:
        """Allocator slots no sequence holds."""
        return self.block_manager.num_free_slots

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
          GrammarError: ``params.structured_outputs`` is rejected by the grammar library, or
            llguidance is not installed (:mod:`paxcache.grammar`).
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.outputs:
            raise DuplicateSequenceError(f"request id {request_id!r} is already running")
        text = prompt if isinstance(prompt, str) else None
        ids = list(self.tokenizer.encode(prompt)) if text is not None else [int(t) for t in prompt]
        check_prompt(
            ids,
            vocab_size=self.model.config.vocab_size,
            max_model_len=self.max_model_len,
            cache_config=self.cache_config,
        )
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        try:
            hash(cache_salt)
        except TypeError:
            raise ValueError(
                f"cache_salt must be hashable, got {type(cache_salt).__name__}"
            ) from None
        make_matcher = self._grammars.factory(params.structured_outputs)  # may raise GrammarError
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**62))
        seqs = new_request(
            request_id,
            ids,
            params,
            seed=seed,
            cache_salt=cache_salt,
            make_decoder=lambda: IncrementalDecoder(self.tokenizer),
            make_matcher=make_matcher,
        )
        self.outputs.add(RequestState(request_id, text, list(ids), params, seqs))
        self.scheduler.add(seqs)

    def abort(self, request_id: str) -> None:
        """Stops a request now and frees its blocks; unknown or finished ids are ignored."""
        req = self.outputs.get(request_id)
        if req is None:
            return
        self.scheduler.finish(req.seqs, "abort")
        self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return len(self.outputs) > 0

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling round and device step (see the module docstring).

        Returns:
          One :class:`RequestOutput` per request that progressed (or finished) in this step,
          with cumulative ``token_ids``/``text`` and this step's deltas in
          ``new_token_ids``/``new_text``.
        """
        if self._auto_warmup and not self._warmed_up:
            logger.info("first step: warming up %d step shapes first", len(self.buckets))
            self.warmup()
        pipe = self._pipeline
        touched = pipe.step() if pipe is not None else self._run(self.scheduler.schedule())
        return self._report(touched)

    def _report(self, touched: list[Seq]) -> list[RequestOutput]:
        """The step's outputs: the output processor detokenizes what ``touched`` sequences
        gained and finds stop strings, which the scheduler then ends (freeing their blocks
        before the next plan), in one pass; a request whose text fails fails alone."""

        def end(stops: list[tuple[Seq, int]], failed: list[str]) -> None:
            if stops:
                self.scheduler.stop_at(stops)
            for req in filter(None, map(self.outputs.get, failed)):
                self.scheduler.finish(req.seqs, "error", INTERNAL_ERROR)

        return self.outputs.report(touched, end)

    def _run(self, plan: StepPlan) -> list[Seq]:
        """Carries ``plan`` out synchronously (swaps, then the step if it has rows), reads and
        post-processes it; returns the sequences touched (the plan's failed ones first)."""
        touched = list(plan.failed)  # finished by the scheduler: they can never fit
        if not (plan.rows or plan.swap_out or plan.swap_in):
            return touched
        try:
            flight = self._dispatch(plan)
            if flight is None:
                return touched
            result = overlap.read(flight, flight.state)
        except StepFailed as e:
            return touched + self._recover(plan, e)
        return touched + self.scheduler.postprocess(plan, result)

    def _dispatch(
        self,
        plan: StepPlan,
        *,
        inputs: step_lib.StepInputs | packing.PackedInputs | None = None,
        state: Any = None,
        free_after: int | None = None,
    ) -> overlap.InFlight | None:
        """Runs ``plan``'s swaps' KV copies, then dispatches its step (JAX returns before the
        device finishes) on ``state`` (default: the block manager's) with ``inputs`` (default
        built from the plan; packed: built on the device). None when the plan has no rows.
        The block manager does not adopt the new state here (``postprocess`` does), so a
        failure at the transfer leaves it holding the donated input, which :meth:`_recover`
        then sees is gone. Raises StepFailed (the cause chained)."""
        try:
            self._move_kv(plan)
        except Exception as e:  # noqa: BLE001 - handled by step(): fails this step's requests
            raise StepFailed(set()) from e
        if not plan.rows:
            return None
        failed: set[str] = set()
        if inputs is None:
            inputs, failed = step_lib.prepare_inputs(plan, self._shapes)
            loop = decode_loop.for_plan(plan, self.scheduler, self._shapes)  # None: one step
            inputs = inputs.replace(decode_loop=loop)
        # What the host knows of them (inputs built on the device: their shapes only).
        host = inputs.structure() if isinstance(inputs, packing.PackedInputs) else inputs
        # Only a single-step continuation reads it (a multi-step one checks on the device).
        if free_after is None and self._pipeline is not None and host.decode_loop is None:
            need = self.scheduler.blocks_needed(plan.rows)
            free_after = self.block_manager.num_free_blocks - need
        state = self.block_manager.state if state is None else state
        try:
            placed = self._place_inputs(inputs)
            with step_lib.tracing_for(self._on_trace):
                state, kv, out = self._jit_step(state, self._device_kv(), self._params, placed)
        except Exception as e:  # noqa: BLE001 - handled by step(): fails this step's requests
            raise StepFailed(failed) from e
        self._kv = self._with_host_pool(kv)
        return overlap.InFlight(plan, host, failed, state, out, free_after, placed=placed)

    def _place_inputs(self, inputs: Any) -> packing.PackedInputs:
        """``inputs`` (:class:`~paxcache.step.StepInputs`, or packed) packed and committed to
        the device, as every step call gets them: one transfer (:mod:`.packing`; a
        continuation's tokens are a device array: :mod:`.overlap`; placement is part of the
        executable)."""
        if not isinstance(inputs, packing.PackedInputs):
            inputs = packing.pack(inputs)
        if self.mesh is None:
            return jax.device_put(inputs, jax.local_devices()[0])
        from paxcache import sharding

        return sharding.place(inputs, sharding.replicated(self.mesh))  # every host's devices

    def _move_kv(self, plan: StepPlan) -> None:
        """The plan's swaps (out, then in), in chunks warm-up compiled (``_max_swap_pairs``)."""
        chunk = max(1, self._max_swap_pairs())
        for pairs, move in ((plan.swap_out, kv_cache.swap_out), (plan.swap_in, kv_cache.swap_in)):
            for i in range(0, len(pairs), chunk):
                src, dst = np.asarray(pairs[i : i + chunk], np.int32).T
                self._kv = move(self._kv, src, dst, impl=self._swap_impl)

    def _recover(self, plan: StepPlan, err: StepFailed) -> list[Seq]:
        """After carrying out a plan raised: fails the requests of that step only. If the step
        had already consumed (donated) the cache, the cache is rebuilt empty and every request
        holding blocks fails too (their KV is gone); queued requests are unaffected.

        Returns the sequences of the failed requests."""
        cause = err.__cause__
        step_seqs = [s for s, _ in plan.rows + plan.samples] + plan.swapped_out + plan.swapped_in
        victims = {s.request_id for s in step_seqs} | set(err.failed)
        logger.error(
            "engine step failed (%s: %s); failing the %d requests in it",
            type(cause).__name__,
            cause,
            len(victims),
            exc_info=cause,
        )
        leaves = jax.tree.leaves((self.block_manager.state, self._kv))
        if any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
            logger.error("the step consumed the KV cache; rebuilding it empty")
            state, self._kv = self._new_device_state()
            victims |= {s.request_id for s in self.scheduler.reset_cache(state)}
        touched: list[Seq] = []
        for rid in victims:
            req = self.outputs.get(rid)
            if req is not None:
                self.scheduler.finish(req.seqs, "error", INTERNAL_ERROR)
                touched += req.seqs
        return touched

    # ------------------------------------------------------------------ conveniences

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs prompts to completion; results come back in input order."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [f"gen-{next(_gen_ids)}" for _ in prompts]
        for rid, p, sp in zip(ids, prompts, params, strict=True):
            self.add_request(rid, p, sp)
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while len(final) < len(ids):
            done = (o for o in self.step() if o.finished and o.request_id in wanted)
            final.update((o.request_id, o) for o in done)
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

    def _empty_step_args(self, t: int, *variant: bool, **flags: bool) -> tuple:
        """``(state, kv, params, inputs)`` of a step with T=t that runs nothing (warm-up,
        AOT compilation, HLO inspection), inputs packed as serving's: ``self._jit_step(*args)``;
        ``masked``, ``decode``, ``prompt_logprobs``: the variants (:func:`step.empty_inputs`)."""
        inputs = packing.pack(step_lib.empty_inputs(self._shapes, t, *variant, **flags))
        return self.block_manager.state, self._device_kv(), self._params, inputs

    def warmup(self) -> None:
        """Compiles every program serving can run (:func:`step.warmup_variants`: each token
        bucket; its constrained (``warmup_structured``), prompt-logprob
        (``warmup_prompt_logprobs``), decode-only and multi-step decode variants), the
        allocator functions and every swap program. A kernel that fails to compile is
        replaced by the XLA path here, with one warning (``stats()["kernel_impls"]``). Logs
        one line per program; a program compiled later logs a warning naming it
        (:func:`step.log_first_use`). :meth:`step` calls this first unless ``warmup=False``."""
        t0 = time.perf_counter()
        compile_cache_lib.check_memory_maps()  # a compile past the kernel's limit aborts
        hits0 = compile_cache_lib.cache_hits()
        compiles0 = self._num_compiled()
        # A TPU kernel Mosaic rejects falls back to XLA here (one warning), not at serving.
        with kernels_pallas.compile_probes():
            masked = self.warmup_structured and grammar.available()
            pl = self.warmup_prompt_logprobs
            variants = step_lib.warmup_variants(self._shapes, masked, prompt_logprobs=pl)
            for i, variant in enumerate(variants):
                tb = time.perf_counter()
                hb = compile_cache_lib.cache_hits()
                state, kv, params, inputs = self._empty_step_args(*variant)
                inputs = self._place_inputs(inputs)
                with step_lib.tracing_for(self._on_trace):
                    state, kv, out = self._jit_step(state, kv, params, inputs)
                self._kv = self._with_host_pool(kv)
                if i == 0 and self._pipeline is not None:  # a plain step: i32[R] samples
                    overlap.warmup_gather(
                        out.sampled.tokens, self._shapes, self.scheduler.max_num_batched_tokens
                    )
                if self._pipeline is not None and variant.loop:
                    overlap.warmup_loop_continuation(inputs, state, out)
                row_ok, num_free = jax.device_get((out.row_ok, out.num_free_blocks))
                # An empty plan: the block manager adopts the (unchanged) state, nothing else.
                self.scheduler.postprocess(
                    StepPlan(), StepResult(state, int(num_free), row_ok, np.zeros(0, np.int32))
                )
                cached = " (compile cache)" if compile_cache_lib.cache_hits() > hb else ""
                logger.info(
                    "warm-up %d/%d: %s ready in %.1fs%s", i + 1, len(variants),
                    variant.describe(), time.perf_counter() - tb, cached,
                )  # fmt: skip
        self.block_manager.warmup()
        byte_decoder = getattr(self.tokenizer, "byte_decoder", None)
        if byte_decoder is not None:
            byte_decoder(True)  # an HF ByteLevel table (~0.1 s for 128K ids): not at request 1
        if self.num_host_blocks > 0:
            # Every swap program (both directions, every pair bucket): no compile at the
            # first preemption.
            self._kv = kv_cache.warmup_swaps(self._kv, self._max_swap_pairs(), impl=self._swap_impl)
        self.stats()
        self._warmed_up = True
        if self.config.freeze_gc:  # EngineConfig.freeze_gc: full collections skip all this
            gc.collect()
            gc.freeze()
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
        events = compile_cache_lib.backend_compiles() - self._compiles_at_start
        return events - (compile_cache_lib.cache_hits() - self._cache_hits_at_start)

    def stats(self) -> dict[str, Any]:
        """Counters and gauges; cheap enough to poll every second. Besides the block,
        prefix-cache and compilation figures, the scheduler's counters (``num_preemptions`` =
        ``num_swaps`` + ``num_preemptions_recompute``: a swap preemption is one swap-out of
        one sequence), queue sizes, ``oldest_waiting_age_s``
        and ``num_traces`` (step programs this engine traced; :func:`step.jitted_step`)."""
        bm, sched = self.block_manager, self.scheduler
        total = self.cache_config.num_blocks
        free = bm.num_free_blocks
        queries, hits = bm.prefix_cache_counts
        oldest = sched.oldest_waiting_arrival()
        return {
            "num_total_blocks": total,
            "num_free_blocks": free,
            "kv_usage": 1.0 - free / total,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "num_preemptions": sched.num_preemptions,
            "num_preemptions_recompute": sched.num_preemptions_recompute,
            "num_swaps": sched.num_swaps,
            "num_swapped_out_blocks": sched.num_swapped_out_blocks,
            "num_swapped_in_seqs": sched.num_swapped_in_seqs,
            "num_swapped_in_blocks": sched.num_swapped_in_blocks,
            "oldest_waiting_age_s": 0.0 if oldest is None else max(0.0, time.monotonic() - oldest),
            "num_compilations": self._num_compiled(),
            "num_compile_cache_hits": compile_cache_lib.cache_hits() - self._cache_hits_at_start,
            "num_traces": self._num_traces,
            "num_running": len(sched.running),
            "num_waiting": sched.num_waiting,
            "num_swapped": len(sched.swapped),
            "num_generated_tokens": sched.num_generated_tokens,
            "num_prompt_tokens": sched.num_prompt_tokens,
            "num_prefill_tokens_computed": sched.num_prefill_tokens_computed,
            "num_free_host_blocks": bm.num_free_host_blocks,
            "num_total_host_blocks": self.num_host_blocks,
            "block_size": self.block_size,
            "bytes_per_block": self.bytes_per_block,
            "kv_cache_bytes": self.bytes_per_block * total,
            "device": ", ".join(str(d) for d in jax.devices()[: self.tp * self.ep]),
            "kernel_impls": kernels_pallas.kernel_info(),
            "max_model_len": self.max_model_len,
            "decode_steps": self.decode_steps,
            "num_multi_step_decodes": sched.num_multi_step_decodes,
            "num_multi_step_iterations": sched.num_multi_step_iterations,
            "num_rope_recomputes": sched.num_rope_recomputes,
            "num_overlapped_steps": self._pipeline.num_continued if self._pipeline else 0,
            "num_wasted_rows": self._pipeline.num_wasted_rows if self._pipeline else 0,
            **quantize.weight_stats(self.model),  # quantization, weight_dtype
            "kv_cache_dtype": jnp.dtype(self._kv.dtype).name,
            "kv_scales": kv_quant.scale_stats(self.kv_scales),  # {"k": [L], "v": [L]} or None
            "kv_scales_source": kv_quant.scales_source(self),  # checkpoint, calibrated, None
        }

    def check_invariants(self) -> dict[str, bool]:
        """Named consistency checks of the whole cache state, all True when consistent (tests
        and debugging; reads the device): the allocator's (``allocator.*``), the block
        manager's (``block_manager.*``, ``free_count_cached``), the scheduler's
        (:meth:`Scheduler.check_invariants <paxcache.scheduler.Scheduler.check_invariants>`),
        every unfinished sequence in one queue (``requests_accounted``) and, with no request
        alive, every block free (``idle_frees_everything``)."""
        bm = self.block_manager
        checks: dict[str, bool] = {}
        for name, ok in bm.check_invariants().items():
            if name == "manager_free_counts_current":
                checks["free_count_cached"] = ok
            elif name.startswith("manager_"):
                checks["block_manager." + name.removeprefix("manager_")] = ok
            else:
                checks["allocator." + name] = ok
        # A step in flight: the tokens its rows feed (a multi-step decode's: steps[j]) past
        # the allocation they had when it went out (``InFlight.slack``) are ahead.
        flight = self._pipeline and self._pipeline.inflight
        fed: list[tuple[Seq, int]] = []
        if flight and flight.out.steps is not None:
            steps = np.asarray(flight.out.steps)
            fed = [(s, int(steps[j])) for s, j in flight.plan.samples]
        elif flight:
            fed = list(flight.plan.rows)
        slack = (flight and flight.slack) or {}
        ahead = {id(s): max(0, n - slack.get(id(s), 0)) for s, n in fed}
        checks.update(self.scheduler.check_invariants(ahead))
        sched = self.scheduler
        live = sched.running + [s for unit in sched.queued for s in unit]
        unfinished = [s for r in self.outputs.requests() for s in r.seqs if not s.is_finished]
        checks["requests_accounted"] = sorted(map(id, unfinished)) == sorted(map(id, live))
        st = jax.device_get({"active": bm.state.active})
        checks["idle_frees_everything"] = len(self.outputs) > 0 or (
            bm.num_free_blocks == self.cache_config.num_blocks
            and bm.num_free_host_blocks == self.num_host_blocks
            and not st["active"].any()
        )
        return checks


_gen_ids = itertools.count()
