#!/usr/bin/env python
"""Serve a model over an OpenAI-compatible HTTP API.

    python scripts/serve.py                       # bundled tiny model on 127.0.0.1:8000 (CPU ok)
    PAXCACHE_API_KEY="$KEY" python scripts/serve.py --model /ckpt/llama --port 8080

Endpoints: POST /v1/completions, POST /v1/chat/completions (``"stream": true`` for SSE),
GET /v1/models, GET /health (503 until warmed up), GET /metrics (Prometheus).

API keys: put them in ``PAXCACHE_API_KEY`` (one key, or several separated by commas) or in a
file (``--api-key-file``, one per line), not on the command line (``--api-key`` works but any
local user can read it in the process list). Each key is a tenant with its own prefix-cache
salt and in-flight limit (see SECURITY.md). ``--allowed-hosts`` checks the Host header.
uvicorn runs with ``limit_concurrency``, a keep-alive timeout, a header size limit and a
header-read timeout (a connection that has not sent a whole request head in
``--header-timeout`` seconds is closed).

Start-up prints one line with the address, model, devices, KV blocks and KV memory, then
compiles every shape bucket (one log line each) before /health reports ready. Compiled steps
are kept in JAX's persistent compilation cache (``--compile-cache DIR``, default
``$XDG_CACHE_HOME/paxcache/jax`` i.e. ``~/.cache/paxcache/jax``; ``--no-compile-cache`` turns
it off), so a restart with the same model and flags loads them instead of compiling.
SIGINT/SIGTERM drain (``paxcache.server.shutdown``): new requests get a 503 (the socket stays
open), in-flight requests may finish until shortly before ``--shutdown-timeout`` seconds, then
the server aborts the rest itself (streams end with ``finish_reason: "abort"``, an error event
and ``[DONE]``; other requests get a JSON 503) and exits 0.

Multi-host (one process per host, e.g. a TPU pod slice): start the same command with
``--multihost`` on every host (plus ``--coordinator-address/--num-processes/--process-id``
where JAX cannot detect them). Process 0 serves HTTP; the others follow its engine steps
(``paxcache.multihost.run_follower``) and exit 0 when process 0 shuts down.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("paxcache.serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="OpenAI-compatible server for paxcache",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--num-blocks", type=int, default=None, help="device KV blocks (None: sized by the engine)"
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--host-blocks", type=int, default=0, help="host (pinned) KV blocks for swap")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (KV heads split)")
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel degree (MoE experts split; ep*tp chips)"
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (repeatable: one "
        "key per tenant). Prefer $PAXCACHE_API_KEY or --api-key-file: a key on the command line "
        "is visible to every local user",
    )
    p.add_argument(
        "--api-key-file", default=None, help="file with one API key per line ('#' comments)"
    )
    p.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host header values to accept (e.g. 'localhost,127.0.0.1'); "
        "others get 400. Guards a key-less server against DNS rebinding",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="most sequences running at once (None: the engine's default for the backend, "
        "64 on CPU, 256 on TPU/GPU)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per engine step (None: the engine's default, 256 on CPU, 2048 on "
        "TPU/GPU)",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights/activations dtype; auto = float32 on CPU, bfloat16 on TPU/GPU",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int8-w8a8", "fp8"],
        help="quantize the layers' weights at load (int8: weight-only; int8-w8a8: int8 "
        "activations too; fp8: e4m3 weights); a pre-quantized checkpoint loads as stored",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8", "fp8"],
        help="KV cache dtype: auto = the model dtype; int8 / fp8 (e4m3): 8-bit pages (half of "
        "bf16's bytes) with per-layer scales calibrated at start-up",
    )
    p.add_argument(
        "--preemption-mode",
        default=None,
        choices=["swap", "recompute"],
        help="None: swap when --host-blocks > 0, else recompute",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="decode iterations one device program runs when a step holds only decode rows "
        "(streams get up to this many tokens per chunk); default 1 on CPU, 8 on TPU/GPU",
    )
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="read every step before dispatching the next (default: a step that needs no "
        "scheduling decision is dispatched while the host post-processes the one before)",
    )
    p.add_argument(
        "--no-structured-warmup",
        action="store_true",
        help="do not compile the constrained-decoding step variants at start-up (the first "
        "constrained request at each token bucket then compiles its own)",
    )
    p.add_argument(
        "--no-prompt-logprobs-warmup",
        action="store_true",
        help="do not compile the echo / prompt-logprob step variants at start-up (the first "
        "such request at each token bucket then compiles its own, logging a warning)",
    )
    p.add_argument("--served-model-name", default=None, help="model id shown to clients")
    p.add_argument("--max-queue", type=int, default=256, help="requests in flight before 429")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit")
    p.add_argument(
        "--max-inflight-per-tenant",
        type=int,
        default=128,
        help="completions one API key (or client address without keys) may have in flight",
    )
    p.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=30.0,
        help="seconds a streaming client may read nothing before its request is aborted",
    )
    p.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds for a request body to arrive"
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=1024,
        help="uvicorn: most open connections and tasks; beyond it new connections get 503",
    )
    p.add_argument(
        "--timeout-keep-alive", type=int, default=5, help="uvicorn: idle keep-alive seconds"
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a request's head (slow-header clients)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGINT/SIGTERM: seconds until the server has ended; in-flight requests may "
        "finish until min(1, T/4) s before, then are aborted (new ones get 503 meanwhile)",
    )
    p.add_argument(
        "--multihost",
        action="store_true",
        help="call jax.distributed.initialize() first; process 0 serves, the others follow it",
    )
    p.add_argument(
        "--coordinator-address",
        default=None,
        help="--multihost: process 0's HOST:PORT (None: detected by JAX, e.g. on TPU)",
    )
    p.add_argument(
        "--num-processes", type=int, default=None, help="--multihost: processes (None: detected)"
    )
    p.add_argument(
        "--process-id", type=int, default=None, help="--multihost: this process (None: detected)"
    )
    cache = p.add_mutually_exclusive_group()
    cache.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR",
        help="persistent compilation cache directory (None: $XDG_CACHE_HOME/paxcache/jax, "
        "i.e. ~/.cache/paxcache/jax); a restart loads the compiled steps instead of compiling",
    )
    cache.add_argument(
        "--no-compile-cache", action="store_true", help="do not use a persistent compile cache"
    )
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def _describe_devices(jax) -> str:  # noqa: ANN001
    devs = jax.devices()
    kinds = sorted({d.device_kind for d in devs})
    return f"{devs[0].platform} x{len(devs)} ({', '.join(kinds)})"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _follow(engine: object, run_follower, index: int, count: int) -> int:  # noqa: ANN001
    """Process ``index`` > 0 of a multi-host server: runs process 0's engine steps until it
    shuts down. A first SIGINT/SIGTERM waits for that (process 0 is being stopped too, usually);
    a second one exits at once."""
    print(
        f"paxcache: process {index}/{count} following process 0 (it serves HTTP)",
        file=sys.stderr,
        flush=True,
    )
    signals = []

    def on_signal(signum: int, frame: object) -> None:
        signals.append(signum)
        if len(signals) > 1:
            print("paxcache: follower interrupted", file=sys.stderr, flush=True)
            os._exit(1)
        print(
            "paxcache: follower waits for process 0 to shut down (signal again to exit now)",
            file=sys.stderr,
            flush=True,
        )

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    run_follower(engine, warmup=True)
    print(f"paxcache: process {index} done", file=sys.stderr, flush=True)
    return 0


def api_keys(args: argparse.Namespace, environ: dict[str, str] | None = None) -> list[str]:
    """The API keys from ``--api-key``, ``--api-key-file`` and ``$PAXCACHE_API_KEY`` (comma-
    separated), in that order, without duplicates.

    Raises:
      SystemExit: the key file cannot be read, or a key is empty or has surrounding spaces.
    """
    environ = os.environ if environ is None else environ
    keys: list[str] = list(args.api_key or [])
    if args.api_key:
        logger.warning(
            "--api-key puts the key in the process list; prefer PAXCACHE_API_KEY or --api-key-file"
        )
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as e:
            raise SystemExit(f"paxcache: cannot read --api-key-file: {e}") from None
        keys += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    env = environ.get("PAXCACHE_API_KEY", "")
    keys += [k.strip() for k in env.split(",") if k.strip()]
    for k in keys:
        if not k or k != k.strip():
            raise SystemExit("paxcache: API keys must be non-empty and without spaces around")
    return list(dict.fromkeys(keys))


def header_timeout_protocol(header_timeout_s: float) -> Any:
    """uvicorn's h11 protocol plus a header-read timeout: a connection that has not sent a
    complete request head ``header_timeout_s`` after it opened (or after its previous
    response) is closed. uvicorn's own keep-alive timer restarts on every byte, so a client
    trickling a header byte at a time would otherwise hold a connection forever.

    Returns ``"h11"`` (uvicorn's plain protocol) when uvicorn's internals differ from what
    this subclass expects."""
    try:
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol
    except ImportError:  # pragma: no cover - depends on the uvicorn version
        logger.warning("uvicorn's h11 protocol not found; no header-read timeout")
        return "h11"

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


def uvicorn_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The uvicorn settings the server runs with (connection and header limits included)."""
    return {
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "access_log": args.log_level in ("debug", "info"),
        "timeout_graceful_shutdown": args.shutdown_timeout,
        "lifespan": "on",
        "limit_concurrency": args.limit_concurrency,
        "timeout_keep_alive": args.timeout_keep_alive,
        "h11_max_incomplete_event_size": 16 * 1024,  # request line + headers
        "http": header_timeout_protocol(args.header_timeout),
        "server_header": False,
    }


def _load_engine(
    engine_cls: type, args: argparse.Namespace, dtype: object, preemption: str
) -> object:
    return engine_cls.from_pretrained(
        args.model,
        dtype=dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_host_blocks=args.host_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=preemption,
        tp=args.tp,
        ep=args.ep,
        max_model_len=args.max_model_len,
        compile_cache=False if args.no_compile_cache else args.compile_cache,
        decode_steps=args.decode_steps,
        async_scheduling=not args.no_async_scheduling,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level in ("warning", "info"):
        # Start-up progress (model load, KV pool, one line per compiled step shape) is shown
        # whatever the log level, short of errors only.
        for name in ("paxcache.engine", "paxcache.compile_cache"):
            logging.getLogger(name).setLevel(logging.INFO)
    keys = api_keys(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        logger.warning(
            "binding %s without --api-key: anyone who can reach it can use it", args.host
        )

    from paxcache.sizing import configure_gpu_allocator

    configure_gpu_allocator()  # before JAX starts: XLA's GPU pool spans 0.95 of the GPU
    import jax

    if args.multihost:
        from paxcache import multihost

        multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    import jax.numpy as jnp
    import uvicorn

    from paxcache.engine import Engine
    from paxcache.multihost import run_follower
    from paxcache.server import ServerLimits, create_app
    from paxcache.server.shutdown import DrainingServer
    from paxcache.step import default_dtype

    platform = jax.devices()[0].platform
    dtype_name = args.dtype
    if dtype_name == "auto":
        dtype_name = jnp.dtype(default_dtype(platform)).name  # as Engine.from_pretrained
    preemption = args.preemption_mode or ("swap" if args.host_blocks > 0 else "recompute")

    t0 = time.monotonic()
    print(f"paxcache: loading {args.model} ({dtype_name}) ...", file=sys.stderr, flush=True)
    # Until uvicorn takes over the signals, SIGTERM interrupts loading like Ctrl+C does.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        engine = _load_engine(Engine, args, getattr(jnp, dtype_name), preemption)
    except KeyboardInterrupt:
        print("paxcache: interrupted while loading", file=sys.stderr)
        return 0
    except (ValueError, OSError) as e:
        print(f"paxcache: cannot load {args.model!r}: {e}", file=sys.stderr)
        return 2
    engine.warmup_structured = not args.no_structured_warmup  # with llguidance installed
    engine.warmup_prompt_logprobs = not args.no_prompt_logprobs_warmup
    stats = engine.stats()  # on every process: multi-host engine calls run in lockstep
    if jax.process_index() != 0:
        return _follow(engine, run_follower, jax.process_index(), jax.process_count())
    name = args.served_model_name or engine.model_name
    try:
        limits = ServerLimits(
            max_queue=args.max_queue,
            max_body_bytes=args.max_body_bytes,
            max_inflight_per_tenant=args.max_inflight_per_tenant,
            stream_stall_timeout_s=args.stream_stall_timeout,
            body_timeout_s=args.body_timeout,
        )
    except ValueError as e:
        print(f"paxcache: {e}", file=sys.stderr)
        return 2
    if args.shutdown_timeout < 0:
        print("paxcache: --shutdown-timeout must be >= 0 seconds", file=sys.stderr)
        return 2
    app = create_app(
        engine,
        api_key=keys,
        served_model_name=name,
        warmup=True,
        limits=limits,
        allowed_hosts=[h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
        if args.allowed_hosts
        else None,
    )
    print(
        f"paxcache serving {name} on http://{args.host}:{args.port} | "
        f"devices {_describe_devices(jax)} | KV {stats.get('num_total_blocks')} blocks x "
        f"{stats.get('block_size', args.block_size)} tokens, "
        f"{_fmt_bytes(float(stats.get('kv_cache_bytes', 0)))} | max_model_len "
        f"{engine.max_model_len} | loaded in {time.monotonic() - t0:.1f}s, warming up "
        f"(/health 503 until ready)",
        flush=True,
    )
    config = uvicorn.Config(app, **uvicorn_config_kwargs(args))
    server = DrainingServer(config, app.state.shutdown, args.shutdown_timeout)
    # The server drains on SIGINT/SIGTERM, then re-raises the signal under the handlers that
    # were installed before it started (as uvicorn does); make those no-ops: a stop exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    code = 0 if server.started else 1
    if app.state.runner.alive:
        # Stopped during warm-up: the engine thread is inside an XLA compilation that cannot be
        # interrupted; finalizing the interpreter under it would abort, so leave at once.
        print("paxcache: stopped during warm-up", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
