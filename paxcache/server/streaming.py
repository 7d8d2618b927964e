"""Streaming responses: server-sent events with a stall timeout.

:func:`stream_events` turns an :class:`paxcache.server.runner.Exchange` into the SSE chunks of
one response (ending in ``data: [DONE]``), and aborts the engine requests that are still
running when it ends early (client gone, stalled, failure). On a failure (engine error,
shutdown) each unfinished choice gets a last chunk with ``finish_reason: "abort"`` (vLLM's
value), then the error event and ``[DONE]``. :class:`EventStream` sends them:
each send must complete within ``stream_stall_timeout_s``, so a client that stops reading is
dropped and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import Response

from paxcache.server.convert import finish_reason, request_error, sse, usage
from paxcache.server.middleware import request_id
from paxcache.server.runner import EngineRunner, Exchange, Progress, fold

__all__ = ["ChunkFn", "EventStream", "stream_events"]

logger = logging.getLogger(__name__)

ChunkFn = Callable[[int, str, "str | None", "list[dict] | None"], dict]
"""``make_chunk(choice_index, text_delta, finish_reason, logprob_entries) -> chunk``."""


async def stream_events(
    runner: EngineRunner,
    ids: list[str],
    exchange: Exchange,
    n: int,
    make_chunk: ChunkFn,
    first_chunks: list[dict],
    usage_chunk: Callable[[dict[str, Any]], dict] | None,
    release: Callable[[], None],
    on_progress: Callable[[int, Progress], None] | None = None,
) -> AsyncIterator[str]:
    """The SSE chunks of one streaming response.

    Args:
      runner: the engine thread (to abort what is unfinished when the stream ends early).
      ids: the engine request ids, one per prompt (tag ``i`` is ``ids[i]``).
      exchange: where the engine thread delivers their outputs.
      n: completions per prompt (choice index = ``tag * n + completion index``).
      make_chunk: builds the chunk of one choice's delta.
      first_chunks: chunks sent before any output (chat: the assistant role).
      usage_chunk: builds the final usage chunk (``stream_options.include_usage``), or None.
      release: frees the tenant's slots (idempotent), called when the stream ends.
      on_progress: called with each ``(tag, progress)`` taken, before its chunks are made
        (the echo of a prompt reads its prompt logprobs there).
    """
    totals = [Progress() for _ in ids]
    reported: set[int] = set()
    exchange.streaming = True
    try:
        for ch in first_chunks:
            yield sse(ch)
        while not all(t.finished for t in totals):
            got, failure = await exchange.take()
            if exchange.disconnected:
                return
            for tag, prog in got.items():
                if on_progress is not None:
                    on_progress(tag, prog)
                for index, comp in sorted(prog.completions.items()):
                    idx = tag * n + index
                    delta = "".join(comp.texts)
                    fr = finish_reason(comp.finish_reason)
                    if delta or comp.logprobs or (fr is not None and idx not in reported):
                        if fr is not None:
                            reported.add(idx)
                        chunk = make_chunk(idx, delta, fr, comp.logprobs)
                        for choice in chunk["choices"]:  # vLLM's, on every streamed choice
                            ended_by_stop = choice.get("finish_reason") in ("stop", "tool_calls")
                            choice["stop_reason"] = comp.stop_reason if ended_by_stop else None
                        yield sse(chunk)
                fold(totals[tag], prog, keep_text=False)
                err = request_error(totals[tag]) if prog.finished else None
                if err is not None:
                    yield sse(err.body())
            if failure is not None and not all(t.finished for t in totals):
                # Engine error or shutdown: every choice still open ends, then the error.
                for idx in range(len(ids) * n):
                    if idx not in reported:
                        yield sse(make_chunk(idx, "", "abort", None))
                yield sse(failure.error().body())
                break
        else:
            if usage_chunk is not None:
                yield sse(usage_chunk(usage(totals)))
        yield "data: [DONE]\n\n"
    finally:
        # Client gone, stalled or a failure: abort what is still running.
        unfinished = [rid for rid, t in zip(ids, totals, strict=True) if not t.finished]
        runner.abort(unfinished)
        release()


class EventStream(Response):
    """Server-sent events from an async iterator of strings.

    Each send must complete within ``stall_timeout_s``: a client that stops reading (its socket
    buffers full) is dropped and the iterator closed, which aborts its engine requests. A
    client that disconnects is noticed at once (``http.disconnect``): ``on_disconnect`` wakes
    the iterator, which then ends by itself (no reliance on task cancellation, which
    ``asyncio.wait_for`` can swallow on Python < 3.12).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[str],
        stall_timeout_s: float,
        *,
        on_stall: Callable[[], None] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.events = events
        self.stall_timeout_s = stall_timeout_s
        self.on_stall = on_stall
        self.on_disconnect = on_disconnect
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.closed = False
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        rid = request_id(scope)

        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.events:
                if self.closed:
                    return
                body = {"type": "http.response.body", "body": chunk.encode(), "more_body": True}
                try:
                    await asyncio.wait_for(send(body), self.stall_timeout_s)
                except TimeoutError:
                    logger.warning(
                        "request %s: client read nothing for %gs; aborting its stream",
                        rid,
                        self.stall_timeout_s,
                    )
                    if self.on_stall is not None:
                        self.on_stall()
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.closed = True
            if self.on_disconnect is not None:
                self.on_disconnect()

        pumping = asyncio.ensure_future(pump())
        watching = asyncio.ensure_future(watch_disconnect())
        try:
            await asyncio.wait([pumping, watching], return_when=asyncio.FIRST_COMPLETED)
            if not pumping.done():  # disconnected: the iterator was woken and ends by itself
                await asyncio.wait([pumping], timeout=self.stall_timeout_s)
        finally:
            watching.cancel()
            if not pumping.done():
                pumping.cancel()
            await asyncio.gather(pumping, watching, return_exceptions=True)
            await self.events.aclose()  # runs the generator's cleanup: aborts what is unfinished
            if self.on_close is not None:  # also when the generator never started
                self.on_close()
        if not pumping.cancelled() and pumping.exception() is not None:
            raise pumping.exception()
