"""Prometheus metrics of the server (``GET /metrics``).

Two sources: :class:`EngineStatsCollector` turns the engine thread's latest ``engine.stats()``
snapshot into gauges and counters when scraped (the engine is never called from the scrape),
and :class:`ServerMetrics` holds the server's own histograms and counters (time to first
token, end-to-end latency, finish reasons, refusals, stalled streams), fed by the engine
thread's hooks and by the handlers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as prometheus_generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from paxcache.outputs import RequestOutput

__all__ = ["CONTENT_TYPE", "EngineStatsCollector", "ServerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""Content type of :meth:`ServerMetrics.render`'s output."""

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class EngineStatsCollector:
    """Exposes the engine thread's latest ``engine.stats()`` snapshot as Prometheus metrics.

    Args:
      runner: anything with ``stats_snapshot`` (dict), ``num_inflight`` and
        ``num_engine_errors`` (an :class:`paxcache.server.runner.EngineRunner`).
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.runner.stats_snapshot
        total = float(s.get("num_total_blocks", 0))
        free = float(s.get("num_free_blocks", total))
        gauges = {
            "paxcache_requests_running": ("Requests running in the engine.", s.get("num_running")),
            "paxcache_requests_waiting": ("Requests waiting in the engine.", s.get("num_waiting")),
            "paxcache_requests_swapped": ("Requests swapped to host.", s.get("num_swapped")),
            "paxcache_kv_blocks_used": ("Device KV blocks in use.", total - free),
            "paxcache_kv_blocks_total": ("Device KV blocks.", total),
            "paxcache_kv_cache_usage_ratio": (
                "Share of device KV blocks in use.",
                s.get("kv_usage"),
            ),
            "paxcache_prefix_cache_hit_rate": (
                "Prefix cache hit rate (tokens).",
                s.get("prefix_cache_hit_rate"),
            ),
            "paxcache_requests_inflight": (
                "Requests accepted by the server, not finished.",
                self.runner.num_inflight,
            ),
            "paxcache_oldest_waiting_request_age_seconds": (
                "Seconds since the oldest request with a queued (waiting or swapped) sequence "
                "arrived.",
                s.get("oldest_waiting_age_s"),
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value or 0.0))
        labelled = {
            "paxcache_preemptions_by_mode_total": (
                "Preemptions by mode.",
                "mode",
                {"swap": "num_preemptions_swap", "recompute": "num_preemptions_recompute"},
            ),
            "paxcache_swapped_sequences_total": (
                "Sequences moved between device and host memory.",
                "direction",
                {"out": "num_swapped_out_seqs", "in": "num_swapped_in_seqs"},
            ),
            "paxcache_swapped_blocks_total": (
                "KV blocks moved between device and host memory.",
                "direction",
                {"out": "num_swapped_out_blocks", "in": "num_swapped_in_blocks"},
            ),
        }
        for name, (doc, label, keys) in labelled.items():
            family = CounterMetricFamily(name, doc, labels=[label])
            for value, key in keys.items():
                family.add_metric([value], float(s.get(key) or 0.0))
            yield family
        counters = {
            "paxcache_generated_tokens_total": ("Tokens generated.", s.get("num_generated_tokens")),
            "paxcache_preemptions_total": ("Sequences preempted.", s.get("num_preemptions")),
            "paxcache_compilations_total": (
                "Step-function compilations.",
                s.get("num_compilations"),
            ),
            "paxcache_swaps_total": ("Swap operations.", s.get("num_swaps")),
            "paxcache_engine_errors_total": (
                "Engine steps that raised.",
                self.runner.num_engine_errors,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(value or 0.0))
        kernels = GaugeMetricFamily(
            "paxcache_kernel_info",
            "Implementation each kernel op runs (1 per op); fallback: why the kernel is not used.",
            labels=["op", "impl", "fallback"],
        )
        for op, impl in sorted((s.get("kernel_impls") or {}).items()):
            family, _, why = impl.partition(" (fallback: ")
            kernels.add_metric([op, family, why.removesuffix(")")], 1.0)
        yield kernels


class ServerMetrics:
    """The server's own metrics, in one registry with the engine's (:meth:`watch`).

    Attributes:
      registry: the ``CollectorRegistry`` that ``/metrics`` renders.
      ttft, e2e: histograms of time to first token and end-to-end request latency.
      finished: engine completions finished, by ``finish_reason``.
      rejected, rejected_tenant: requests refused with 429 (queue full / tenant limit).
      stalled: streams dropped because the client stopped reading.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "paxcache_time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "paxcache_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            "paxcache_requests_finished",
            "Engine requests finished, by reason.",
            ["finish_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "paxcache_requests_rejected",
            "Requests refused with 429 (queue full).",
            registry=self.registry,
        )
        self.rejected_tenant = Counter(
            "paxcache_requests_rejected_tenant",
            "Requests refused with 429 (the tenant's in-flight limit).",
            registry=self.registry,
        )
        self.stalled = Counter(
            "paxcache_streams_stalled",
            "Streams dropped because the client stopped reading.",
            registry=self.registry,
        )

    def watch(self, runner: Any) -> None:
        """Adds the engine's stats (:class:`EngineStatsCollector` over ``runner``)."""
        self.registry.register(EngineStatsCollector(runner))

    def first_token(self, seconds: float) -> None:
        """Engine-thread hook: a request got its first token ``seconds`` after submission."""
        self.ttft.observe(seconds)

    def request_finished(self, out: RequestOutput, seconds: float) -> None:
        """Engine-thread hook: a request finished ``seconds`` after submission."""
        self.e2e.observe(seconds)
        for o in out.outputs:
            self.finished.labels(finish_reason=str(o.finish_reason)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (:data:`CONTENT_TYPE`)."""
        return prometheus_generate_latest(self.registry)
