"""Request and completion outputs returned by the engine (vLLM-compatible field names)."""

from __future__ import annotations

from dataclasses import dataclass, field

INTERNAL_ERROR = "internal error while processing this request"
"""``RequestOutput.error`` of a request that failed inside the engine (the details are logged,
never reported: they may hold paths or internals)."""


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions.

    Attributes:
      index: which of the ``n`` completions this is.
      token_ids: every generated token so far (cumulative); with
        ``SamplingParams(output_kind="delta")`` only the tokens new since the previous output.
      text: the detokenized text so far, ending before a matched stop string (delta: the new
        text only).
      finish_reason: ``None`` while running, else ``"stop"``, ``"length"``, ``"abort"`` or
        ``"error"``.
      logprobs: per generated token, ``{"token_id", "logprob", "top": [(id, logprob), ...]}``
        when the request asked for logprobs, else ``None`` (delta: the new tokens' entries).
      new_token_ids: the tokens generated in the step that produced this output.
      new_text: the text added in the step that produced this output.
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict] | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""


@dataclass
class RequestOutput:
    """Everything known about one request after a step (or at the end of ``generate``).

    Attributes:
      request_id: the id given to ``add_request``.
      prompt: the prompt text (``None`` for a token-id prompt).
      prompt_token_ids: the prompt's tokens.
      outputs: the completions (with ``output_kind="delta"``, possibly only those that
        progressed).
      finished: no more outputs will come for this request.
      error: why the request failed, if it did (its completions finish with ``"error"``).
      num_cached_tokens: prompt tokens served from the prefix cache at admission (``None``
        until the request is admitted); OpenAI's ``usage.prompt_tokens_details.cached_tokens``.
      num_preemptions: times a completion of this request was preempted so far (swap or
        recompute; a prompt shared by waiting completions counts once per completion).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
