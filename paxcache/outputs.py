"""Request and completion outputs returned by the engine (vLLM-compatible field names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions.

    Attributes:
      index: which of the ``n`` completions this is.
      token_ids: every generated token so far (cumulative).
      text: the detokenized text so far, ending before a matched stop string.
      finish_reason: ``None`` while running, else ``"stop"``, ``"length"``, ``"abort"`` or
        ``"error"``.
      logprobs: per generated token, ``{"token_id", "logprob", "top": [(id, logprob), ...]}``
        when the request asked for logprobs, else ``None``.
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
      prompt: the prompt text, or ``None`` when the prompt was given as token ids.
      prompt_token_ids: the prompt's token ids.
      outputs: one :class:`CompletionOutput` per completion (``n`` of them).
      finished: every completion has finished.
      error: why a completion finished with ``finish_reason="error"``, else ``None``.
      num_preemptions: times a completion of this request was preempted so far (swap or
        recompute; a prompt shared by waiting completions counts once per completion).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    num_preemptions: int = 0
