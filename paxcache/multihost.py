"""Multi-host lockstep: every process makes the same engine calls in the same order.

With ``jax.process_count() > 1`` the engine's jitted step is one SPMD program over every
host's devices, so every process must add, abort and step the same requests in the same
order. Only process 0 serves HTTP; its engine thread (the server's ``EngineRunner``) starts
each round by broadcasting it as an :class:`EngineRound` (:func:`broadcast_round`, through
``sharding.broadcast_from_leader``): the new requests, the aborts, whether to sample stats, and
a shutdown flag; then it applies them and steps. Every other process runs
:func:`run_follower`, which receives the same round (:func:`receive_round`). Both apply a round
with the same code, :meth:`EngineLoop.run_round` (aborts, adds, the step, stats; on a failed
step every live request aborted), so they make the same calls in the same order. Requests
without a seed get one drawn on process 0 (:func:`with_leader_seed`), so sampling matches on
every host. While idle the leader still sends an empty round every :data:`HEARTBEAT_S`
seconds; on shutdown it sends a final round that ends the followers.

Rounds travel as JSON of known fields, validated on receipt (:meth:`EngineRound.from_wire`),
never pickle: a follower must not run whatever reaches the channel.

This module sits beside the engine: it imports the sampling parameters and the sharding
helpers, never the server (which imports it: a single-host server runs :class:`EngineLoop` too,
without broadcasting).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paxcache.errors import PaxcacheError
from paxcache.sampling import SamplingParams

__all__ = [
    "HEARTBEAT_S",
    "MAX_REQUEST_ID_CHARS",
    "EngineLoop",
    "EngineRound",
    "RoundAdd",
    "RoundError",
    "RoundResult",
    "broadcast_round",
    "process_count",
    "receive_round",
    "run_follower",
    "with_leader_seed",
]

logger = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
"""Most seconds between two broadcast rounds while the leader is idle."""

MAX_REQUEST_ID_CHARS = 256
"""Longest request id a round may carry."""


class RoundError(PaxcacheError):
    """A multi-host round received from process 0 does not match the schema."""


_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(frozen=True)
class RoundAdd:
    """One request of a round: ``engine.add_request(request_id, prompt, params,
    cache_salt=cache_salt)``."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None = None


@dataclass(frozen=True)
class EngineRound:
    """What process 0 broadcasts each round (see the module docstring).

    Attributes:
      stop: the server is shutting down; followers return after the aborts.
      aborts: request ids to abort, in order.
      adds: requests to add, in order.
      stats: sample ``engine.stats()`` after this round's step (a round without a step
        samples them anyway).
    """

    stop: bool
    aborts: tuple[str, ...]
    adds: tuple[RoundAdd, ...]
    stats: bool

    def to_wire(self) -> dict[str, Any]:
        """A JSON-serializable dict (``sharding.broadcast_from_leader`` sends JSON)."""
        return {
            "stop": self.stop,
            "aborts": list(self.aborts),
            "adds": [
                {
                    "request_id": a.request_id,
                    "prompt": a.prompt,
                    "params": {
                        k: list(v) if isinstance(v, tuple) else v
                        for k, v in dataclasses.asdict(a.params).items()
                    },
                    "cache_salt": a.cache_salt,
                }
                for a in self.adds
            ],
            "stats": self.stats,
        }

    @classmethod
    def from_wire(cls, d: Any) -> EngineRound:
        """Validates a received round: exactly the known fields, each of the right type.

        Raises:
          RoundError: naming the first field that does not match.
        """

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise RoundError(f"invalid multi-host round: {what}")

        def is_id(x: Any) -> bool:
            return isinstance(x, str) and 0 < len(x) <= MAX_REQUEST_ID_CHARS

        need(isinstance(d, dict) and set(d) == {"stop", "aborts", "adds", "stats"}, "fields")
        need(isinstance(d["stop"], bool) and isinstance(d["stats"], bool), "stop/stats")
        need(isinstance(d["aborts"], list) and all(map(is_id, d["aborts"])), "aborts")
        need(isinstance(d["adds"], list), "adds")
        adds = []
        for a in d["adds"]:
            need(
                isinstance(a, dict) and set(a) == {"request_id", "prompt", "params", "cache_salt"},
                "add fields",
            )
            need(is_id(a["request_id"]), "add request_id")
            p = a["prompt"]
            need(
                isinstance(p, str)
                or (
                    isinstance(p, list)
                    and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                ),
                "add prompt",
            )
            need(a["cache_salt"] is None or isinstance(a["cache_salt"], str), "add cache_salt")
            params = a["params"]
            need(isinstance(params, dict) and set(params) == set(_PARAM_FIELDS), "add params")
            try:
                sp = SamplingParams(**params)
            except (ValueError, TypeError) as e:
                raise RoundError(f"invalid multi-host round: add params: {e}") from None
            adds.append(RoundAdd(a["request_id"], p, sp, a["cache_salt"]))
        return cls(d["stop"], tuple(d["aborts"]), tuple(adds), d["stats"])


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """``jax.distributed.initialize`` with the settings lockstep serving needs; call it first.

    Two settings come before it. CPU devices talk over gloo (a no-op for TPU and GPU devices).
    And each op's location is its innermost user frame only
    (``jax_include_full_tracebacks_in_locations=False``): with full tracebacks, the compiled
    step carries the Python call stack that traced it, which differs between process 0 (the
    server's engine thread) and a follower (:func:`run_follower` in its main thread), and from
    JAX 0.12.1 on the two processes' CPU collectives then never meet (the programs differ only
    in that metadata; both processes hang in the first step). The innermost frame is the same
    model code on every process.
    """
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    dist = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    jax.distributed.initialize(**{k: v for k, v in dist.items() if v is not None})


def process_count() -> int:
    """``jax.process_count()`` if JAX is already imported (never imports it: fake engines)."""
    jax = sys.modules.get("jax")
    return int(jax.process_count()) if jax is not None else 1


def with_leader_seed(params: SamplingParams) -> SamplingParams:
    """``params`` with a seed drawn here when it has none, so every host samples alike."""
    if params.seed is not None:
        return params
    return dataclasses.replace(params, seed=secrets.randbits(62))


def broadcast_round(rnd: EngineRound) -> None:
    """Process 0: sends ``rnd`` to every follower (blocks until all have it)."""
    from paxcache import sharding

    sharding.broadcast_from_leader(rnd.to_wire())


def receive_round() -> EngineRound:
    """A follower: receives process 0's next round.

    Raises:
      RoundError: the round does not match the schema.
    """
    from paxcache import sharding

    try:
        return EngineRound.from_wire(sharding.broadcast_from_leader(None))
    except (RoundError, ValueError) as e:
        logger.error("follower received an invalid round from process 0: %s", e)
        raise RoundError(str(e)) from None


@dataclass
class RoundResult:
    """What :meth:`EngineLoop.run_round` did with one round.

    Attributes:
      stopped: a stop round: its aborts were applied and nothing else.
      added: the ids ``engine.add_request`` accepted, in order.
      refused: request id -> the exception ``engine.add_request`` raised (not re-raised: the
        leader answers the request with it, a follower got the same one and goes on).
      stepped: ``engine.step()`` was called (whether or not it raised).
      outputs: the step's ``RequestOutput`` list (empty without a step or when it raised).
      step_error: what ``engine.step()`` raised, or None.
      aborted_on_error: the live requests aborted because the step raised, in order.
      stats: ``engine.stats()`` sampled after the round, or None (not sampled or it raised).
    """

    stopped: bool = False
    added: list[str] = dataclasses.field(default_factory=list)
    refused: dict[str, Exception] = dataclasses.field(default_factory=dict)
    stepped: bool = False
    outputs: list[Any] = dataclasses.field(default_factory=list)
    step_error: Exception | None = None
    aborted_on_error: list[str] = dataclasses.field(default_factory=list)
    stats: dict[str, Any] | None = None


class EngineLoop:
    """Applies rounds to an engine: the one loop body that process 0's engine thread (the
    server's ``EngineRunner``) and every follower (:func:`run_follower`) run, so every host
    makes the same engine calls in the same order.

    Args:
      engine: an object with the ``Engine`` interface (``add_request(..., cache_salt=)``,
        ``step``, ``abort``, ``has_unfinished_requests``, ``stats``, ``warmup``).

    Attributes:
      live: the requests added and not yet finished or aborted, in the order they were added
        (on process 0: the requests the server answers).
      last_stats_t: ``time.monotonic()`` of the last ``engine.stats()`` call (0: none yet).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.live: dict[str, None] = {}
        self.last_stats_t = 0.0

    def warmup(self) -> str | None:
        """``engine.warmup()``; returns None, or an error message when it raised (logged)."""
        try:
            t0 = time.monotonic()
            self.engine.warmup()
            logger.info("engine warm-up done in %.1fs", time.monotonic() - t0)
        except Exception:  # noqa: BLE001 - the server reports it; followers keep going
            logger.exception("engine warm-up failed")
            return "warm-up failed (see the server log)"
        return None

    def sample_stats(self) -> dict[str, Any] | None:
        """``dict(engine.stats())``, or None when it raised (logged: metrics never take the
        engine down)."""
        self.last_stats_t = time.monotonic()
        try:
            return dict(self.engine.stats())
        except Exception:  # noqa: BLE001
            logger.exception("engine.stats() failed")
            return None

    def abort(self, request_id: str) -> None:
        """``engine.abort(request_id)`` (errors logged); it is no longer live."""
        self.live.pop(request_id, None)
        try:
            self.engine.abort(request_id)
        except Exception:  # noqa: BLE001
            logger.exception("engine.abort(%r) failed", request_id)

    def abort_live(self) -> list[str]:
        """Aborts every live request, in order; returns their ids."""
        ids = list(self.live)
        for rid in ids:
            self.abort(rid)
        return ids

    def _has_work(self) -> bool:
        try:
            return bool(self.engine.has_unfinished_requests())
        except Exception:  # noqa: BLE001
            logger.exception("engine.has_unfinished_requests() failed")
            return False

    def run_round(
        self, rnd: EngineRound, *, admitted: Callable[[RoundResult], None] | None = None
    ) -> RoundResult:
        """Applies one round: its aborts in order; on a stop round, nothing more (stats are
        sampled); else its adds in order, ``engine.step()`` when the engine has unfinished
        requests (should it raise, every live request is aborted, in order), and
        ``engine.stats()`` when ``rnd.stats`` or when there was nothing to step.

        Never raises for an engine error: every one is logged or recorded in the result.

        Args:
          rnd: the round (process 0 built it; followers received it).
          admitted: called once the adds are applied, before the step (not on a stop round),
            with the result so far (``added``, ``refused``), so process 0 answers them without
            waiting for the step.
        """
        result = RoundResult()
        for rid in rnd.aborts:
            self.abort(rid)
        if rnd.stop:
            result.stopped = True
            result.stats = self.sample_stats()
            return result
        for add in rnd.adds:
            try:
                self.engine.add_request(
                    add.request_id, add.prompt, add.params, cache_salt=add.cache_salt
                )
            except Exception as e:  # noqa: BLE001 - recorded: process 0 answers the request
                logger.debug("request %s refused by the engine: %r", add.request_id, e)
                result.refused[add.request_id] = e
                continue
            self.live[add.request_id] = None
            result.added.append(add.request_id)
        if admitted is not None:
            admitted(result)
        if not self._has_work():
            result.stats = self.sample_stats()
            return result
        result.stepped = True
        try:
            result.outputs = list(self.engine.step())
        except Exception as e:  # noqa: BLE001 - the requests in flight fail, the loop goes on
            logger.exception(
                "engine.step() failed; aborting the %d requests in flight", len(self.live)
            )
            result.step_error = e
            result.aborted_on_error = self.abort_live()
        for out in result.outputs:
            if out.finished:
                self.live.pop(out.request_id, None)
        if rnd.stats:
            result.stats = self.sample_stats()
        return result


def run_follower(engine: Any, *, warmup: bool = True) -> None:
    """Runs ``engine`` on a process other than 0 of a multi-host server, until it shuts down.

    Runs process 0's loop (see the module docstring): warms up, samples stats, then each
    round receives process 0's :class:`EngineRound` and applies it with
    :meth:`EngineLoop.run_round`, the method process 0 applies it with, discarding the
    outputs. Returns when process 0 sends its shutdown round.

    Args:
      engine: this process's ``Engine``, built with the same arguments as process 0's.
      warmup: call ``engine.warmup()`` first (as process 0's ``create_app(warmup=)``).

    Raises:
      RoundError: a received round does not match the schema (the hosts can no longer stay
        in lockstep, so the follower stops rather than guess).
    """
    loop = EngineLoop(engine)
    if warmup:
        loop.warmup()
    loop.sample_stats()
    while True:
        if loop.run_round(receive_round()).stopped:
            logger.info("leader shut down; follower exiting")
            return
