"""Echo and prompt log-probabilities of the completions and chat endpoints.

``/v1/completions`` with ``echo: true`` returns the prompt before each completion; with
``logprobs: k`` too, its OpenAI ``logprobs`` object covers the prompt tokens first (the first
with ``null`` log-probability, as it has no context) and then the generated ones, which is how
evaluation harnesses (lm-eval's ``local-completions``) score a continuation. ``max_tokens: 0``
returns the prompt alone: the engine still runs the prefill and samples one token (as vLLM
does), which the response drops. vLLM's ``prompt_logprobs`` extension (both endpoints, not
streaming) returns vLLM's shape: per prompt token ``None`` (the first) or ``{token_id:
{"logprob", "rank", "decoded_token"}}`` holding the prompt token and the top alternatives.

The log-probabilities are computed by the engine in the prefill the request runs anyway
(``SamplingParams.prompt_logprobs``); such a request recomputes every prompt token rather
than reading the prefix cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from paxcache.sampling import SamplingParams
from paxcache.server.protocol import APIError, CompletionRequest, SamplingFields, ServerLimits

__all__ = [
    "EchoPlan",
    "check_prompt_logprobs",
    "echo_plan",
    "echo_text",
    "prompt_entries",
    "vllm_prompt_logprobs",
]


@dataclasses.dataclass(frozen=True)
class EchoPlan:
    """What a completions request asks of the prompt.

    Attributes:
      echo: return the prompt (and, with ``logprobs``, its log-probabilities) first.
      echo_logprobs: top alternatives per echoed prompt token, or None (no logprobs).
      drop_generated: ``max_tokens: 0``: the completion is the prompt alone.
      engine_prompt_logprobs: ``SamplingParams.prompt_logprobs`` for the engine, or None.
    """

    echo: bool = False
    echo_logprobs: int | None = None
    drop_generated: bool = False
    engine_prompt_logprobs: int | None = None

    def params(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the prompt log-probabilities this plan needs."""
        if self.engine_prompt_logprobs is None:
            return params
        return dataclasses.replace(params, prompt_logprobs=self.engine_prompt_logprobs)


def check_prompt_logprobs(body: SamplingFields, limits: ServerLimits) -> None:
    """``prompt_logprobs`` within ``max_logprobs`` and not with ``stream`` (as vLLM)."""
    k = body.prompt_logprobs
    if k is None:
        return
    if k > limits.max_logprobs:
        raise APIError(
            400,
            f"prompt_logprobs={k}; at most {limits.max_logprobs} (limit max_logprobs)",
            param="prompt_logprobs",
        )
    if body.stream:
        raise APIError(
            400,
            "prompt_logprobs is not available with stream=true (use echo with logprobs on "
            "/v1/completions)",
            param="prompt_logprobs",
        )


def echo_plan(body: CompletionRequest, has_tokenizer: bool) -> EchoPlan:
    """The :class:`EchoPlan` of a completions request (400 for ``max_tokens: 0`` without
    ``echo``, or ``echo`` on an engine with no tokenizer)."""
    if body.max_tokens == 0 and not body.echo:
        raise APIError(
            400, "max_tokens must be at least 1 (0 is allowed with echo=true)", param="max_tokens"
        )
    if body.echo and not has_tokenizer:
        raise APIError(400, "echo needs a tokenizer; this engine has none", param="echo")
    echo_lp = body.logprobs if body.echo else None
    wanted = [k for k in (echo_lp, body.prompt_logprobs) if k is not None]
    return EchoPlan(
        echo=body.echo,
        echo_logprobs=echo_lp,
        drop_generated=body.max_tokens == 0,
        engine_prompt_logprobs=max(wanted) if wanted else None,
    )


def echo_text(tokenizer: Any, prompt: str | list[int], ids: Sequence[int]) -> str:
    """The echoed prompt: the text as sent, or the decoded token ids."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(list(ids))


def prompt_entries(
    ids: Sequence[int], prompt_logprobs: Sequence[dict | None] | None, k: int
) -> list[dict]:
    """The engine's logprob entries (``{"token_id", "logprob", "top"}``) of the prompt tokens,
    the first with ``logprob`` None, each with at most ``k`` alternatives."""
    lps = prompt_logprobs or [None] * len(ids)
    out = []
    for tid, e in zip(ids, lps, strict=False):
        if e is None:
            out.append({"token_id": int(tid), "logprob": None, "top": None})
        else:
            out.append({"token_id": e["token_id"], "logprob": e["logprob"], "top": e["top"][:k]})
    return out


def vllm_prompt_logprobs(
    tokenizer: Any, prompt_logprobs: Sequence[dict | None] | None, k: int
) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs`` shape: per prompt token None (the first) or ``{str(token_id):
    {"logprob", "rank", "decoded_token"}}`` with the prompt token and its top ``k``."""
    if prompt_logprobs is None:
        return None

    def decoded(tid: int) -> str:
        if tokenizer is None:
            return ""
        try:
            return tokenizer.decode([tid], skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - a token the tokenizer cannot show
            return ""

    out: list[dict | None] = []
    for e in prompt_logprobs:
        if e is None:
            out.append(None)
            continue
        tid = e["token_id"]
        d = {
            str(tid): {
                "logprob": e["logprob"],
                "rank": e.get("rank"),
                "decoded_token": decoded(tid),
            }
        }
        for rank, (top_id, lp) in enumerate(e["top"][:k], start=1):
            d.setdefault(
                str(top_id), {"logprob": lp, "rank": rank, "decoded_token": decoded(top_id)}
            )
        out.append(d)
    return out
