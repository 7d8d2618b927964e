"""Prometheus metrics of the server (``GET /metrics``).

Two sources: :class:`EngineStatsCollector` turns the engine thread's latest ``engine.stats()``
snapshot into gauges and counters when scraped (the engine is never called from the scrape),
and :class:`ServerMetrics` holds the server's own histograms and counters (time to first
token, inter-token and end-to-end latency, finish reasons, refusals, stalled streams), fed by
the engine thread's hooks and by the handlers.

Beside the ``paxcache_*`` names, the gateway metrics are exported under vLLM's names, with
vLLM's ``model_name`` label, so routers that read vLLM's metrics (the Kubernetes Gateway API
inference extension, llm-d) work unchanged: ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:num_requests_swapped``, ``vllm:kv_cache_usage_perc``
(0..1; also under its older name ``vllm:gpu_cache_usage_perc``), ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:num_preemptions_total``,
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``,
``vllm:request_success_total`` (by ``finished_reason``) and the histograms
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:time_per_output_token_seconds`` and ``vllm:e2e_request_latency_seconds``. Every ending
counts, as in vLLM: a request aborted (client disconnect, stream stall timeout, shutdown,
explicit abort) counts its completions under ``finished_reason="abort"`` and its latency in
the end-to-end and per-output-token histograms. Running and waiting count sequences (an
``n > 1`` request counts ``n``), as the scheduler sees them.
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
# vLLM's buckets, so dashboards built for vLLM read the same quantiles.
_VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_VLLM_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class EngineStatsCollector:
    """Exposes the engine thread's latest ``engine.stats()`` snapshot as Prometheus metrics.

    Args:
      runner: anything with ``stats_snapshot`` (dict), ``num_inflight`` and
        ``num_engine_errors`` (an :class:`paxcache.server.runner.EngineRunner`).
      model_name: the ``model_name`` label of the ``vllm:*`` metrics (None: not exported).
    """

    def __init__(self, runner: Any, model_name: str | None = None) -> None:
        self.runner = runner
        self.model_name = model_name

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
                {"swap": "num_swaps", "recompute": "num_preemptions_recompute"},
            ),
            "paxcache_swapped_sequences_total": (
                "Sequences moved between device and host memory.",
                "direction",
                {"out": "num_swaps", "in": "num_swapped_in_seqs"},  # a swap moves one seq
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
        if "weight_dtype" in s:
            weights = GaugeMetricFamily(
                "paxcache_weights_info",
                "The served weights (1): quantization scheme (none: unquantized), the layer "
                "weights' and the KV cache's storage dtypes.",
                labels=["quantization", "weight_dtype", "kv_cache_dtype"],
            )
            labels = [s.get("quantization") or "none", s["weight_dtype"]]
            weights.add_metric([*labels, str(s.get("kv_cache_dtype", ""))], 1.0)
            yield weights
        if self.model_name is not None:
            yield from self._vllm(s)

    def _vllm(self, s: dict[str, Any]) -> Iterator[Metric]:
        """The engine's gauges and counters under vLLM's names."""
        label = [self.model_name]
        usage = "KV-cache usage: 1 means every device block is in use."
        gauges = {
            "vllm:num_requests_running": ("Sequences running.", s.get("num_running")),
            "vllm:num_requests_waiting": ("Sequences waiting.", s.get("num_waiting")),
            "vllm:num_requests_swapped": ("Sequences swapped to host.", s.get("num_swapped")),
            "vllm:kv_cache_usage_perc": (usage, s.get("kv_usage")),
            "vllm:gpu_cache_usage_perc": (usage + " (vLLM's older name)", s.get("kv_usage")),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, float(value or 0.0))
            yield g
        counters = {
            "vllm:prompt_tokens": ("Prompt tokens of requests added.", "num_prompt_tokens"),
            "vllm:generation_tokens": ("Tokens generated.", "num_generated_tokens"),
            "vllm:num_preemptions": ("Sequences preempted.", "num_preemptions"),
            "vllm:prefix_cache_queries": (
                "Prefix-cache lookups (blocks queried).",
                "prefix_cache_queries",
            ),
            "vllm:prefix_cache_hits": ("Prefix-cache hits (blocks found).", "prefix_cache_hits"),
        }
        for name, (doc, key) in counters.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, float(s.get(key) or 0.0))
            yield c


class ServerMetrics:
    """The server's own metrics, in one registry with the engine's (:meth:`watch`).

    Attributes:
      registry: the ``CollectorRegistry`` that ``/metrics`` renders.
      ttft, e2e: histograms of time to first token and end-to-end request latency.
      finished: engine completions ended, by ``finish_reason`` (``"abort"``: aborted; every
        ending counts, and its latency too).
      rejected, rejected_tenant: requests refused with 429 (queue full / tenant limit).
      stalled: streams dropped because the client stopped reading.
      vllm_ttft, vllm_itl, vllm_tpot, vllm_e2e, vllm_success: the same under vLLM's names,
        labelled ``model_name`` (see the module docstring); exported once :meth:`watch` named
        the model.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.model_name: str | None = None
        self.vllm_ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            ["model_name"],
            buckets=_VLLM_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.vllm_itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two generated tokens of a completion.",
            ["model_name"],
            buckets=_VLLM_ITL_BUCKETS,
            registry=self.registry,
        )
        self.vllm_tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Per request: (end-to-end latency - time to first token) / (generated tokens - 1).",
            ["model_name"],
            buckets=_VLLM_ITL_BUCKETS,
            registry=self.registry,
        )
        self.vllm_e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            ["model_name"],
            buckets=_VLLM_E2E_BUCKETS,
            registry=self.registry,
        )
        self.vllm_success = Counter(
            "vllm:request_success",
            "Completions finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
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

    def watch(self, runner: Any, model_name: str | None = None) -> None:
        """Adds the engine's stats (:class:`EngineStatsCollector` over ``runner``); with
        ``model_name``, the ``vllm:*`` metrics too, under that label."""
        self.model_name = model_name
        self.registry.register(EngineStatsCollector(runner, model_name))
        if model_name is not None:  # exported at 0 from the start, as vLLM does
            for h in (self.vllm_ttft, self.vllm_itl, self.vllm_tpot, self.vllm_e2e):
                h.labels(model_name)
            for reason in ("stop", "length", "abort", "error"):
                self.vllm_success.labels(model_name=model_name, finished_reason=reason)

    def first_token(self, seconds: float) -> None:
        """Engine-thread hook: a request got its first token ``seconds`` after submission."""
        self.ttft.observe(seconds)
        if self.model_name is not None:
            self.vllm_ttft.labels(self.model_name).observe(seconds)

    def tokens(self, seconds: float, count: int) -> None:
        """Engine-thread hook: a completion that already had tokens got ``count`` more,
        ``seconds`` after its previous ones (each counts as one gap of ``seconds / count``)."""
        if self.model_name is not None and count > 0:
            h = self.vllm_itl.labels(self.model_name)
            for _ in range(count):
                h.observe(seconds / count)

    def request_finished(
        self,
        out: RequestOutput,
        seconds: float,
        first_token_s: float | None = None,
        num_tokens: int = 0,
    ) -> None:
        """Engine-thread hook: a request finished ``seconds`` after submission, its first
        token ``first_token_s`` after submission (None: it generated none), having generated
        ``num_tokens`` tokens over its ``n`` completions."""
        reasons = [str(o.finish_reason) for o in out.outputs]
        self._ended(reasons, seconds, first_token_s, num_tokens)

    def request_aborted(
        self,
        reason: str,
        completions: int,
        seconds: float,
        first_token_s: float | None = None,
        num_tokens: int = 0,
    ) -> None:
        """Engine-thread hook: a request ended unfinished (``reason`` ``"abort"``: client
        gone, stream stalled, shutdown, explicit abort; ``"error"``: an engine error) after
        ``seconds``; its ``completions`` count under that reason and its latency is observed,
        as vLLM counts aborted requests."""
        self._ended([reason] * completions, seconds, first_token_s, num_tokens)

    def _ended(
        self, reasons: list[str], seconds: float, first_token_s: float | None, num_tokens: int
    ) -> None:
        self.e2e.observe(seconds)
        for reason in reasons:
            self.finished.labels(finish_reason=reason).inc()
        if self.model_name is None:
            return
        self.vllm_e2e.labels(self.model_name).observe(seconds)
        for reason in reasons:
            self.vllm_success.labels(model_name=self.model_name, finished_reason=reason).inc()
        per_completion = num_tokens / max(1, len(reasons))
        if first_token_s is not None and per_completion > 1:
            tpot = (seconds - first_token_s) / (per_completion - 1)
            self.vllm_tpot.labels(self.model_name).observe(max(0.0, tpot))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (:data:`CONTENT_TYPE`)."""
        return prometheus_generate_latest(self.registry)
