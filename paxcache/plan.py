"""What one step runs and what it returned: :class:`StepPlan` (made by
:meth:`Scheduler.schedule <paxcache.scheduler.Scheduler.schedule>`) and :class:`StepResult`
(read from the device by :func:`paxcache.step.read_result`, taken by
:meth:`Scheduler.postprocess <paxcache.scheduler.Scheduler.postprocess>`). Both are
re-exported by :mod:`paxcache.scheduler`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection

import numpy as np

from paxcache.sequence import Sequence

__all__ = ["StepPlan", "StepResult", "record_prompt_logprobs"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepPlan:
    """What one step runs, and what :meth:`Scheduler.schedule` changed to make room for it.

    Attributes:
      rows: ``(seq, q)`` in batch order: ``q`` tokens of ``seq`` are fed.
      slots: the block-manager slot of each row's sequence.
      samples: ``(seq, row_index)``: ``seq`` samples its next token from the logits of the
        last token of batch row ``row_index`` (a follower samples from its leader's row).
      swap_out: ``(device_block, host_block)`` copies to make before the step (the blocks of
        the sequences swapped out).
      swap_in: ``(host_block, device_block)`` copies to make before the step, after
        ``swap_out`` (never both in one step: rule R3).
      swapped_out: sequences preempted by swapping (their KV is in ``swap_out``).
      swapped_in: sequences resumed from the host (their KV is in ``swap_in``).
      admitted: sequences given blocks this step (new, or resumed after a recompute).
      preempted: sequences preempted this step (swapped out or freed for recompute).
      failed: sequences the scheduler finished with an error (they can never fit).
      prompt_positions: ``(row_index, position)``: the step also computes the log-probability
        of prompt token ``position + 1`` from the logits of that row's token at ``position``
        (rows of sequences with ``prompt_logprobs``, every position of the row that has a
        next prompt token).
    """

    rows: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    slots: list[int] = dataclasses.field(default_factory=list)
    samples: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swapped_out: list[Sequence] = dataclasses.field(default_factory=list)
    swapped_in: list[Sequence] = dataclasses.field(default_factory=list)
    admitted: list[Sequence] = dataclasses.field(default_factory=list)
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    failed: list[Sequence] = dataclasses.field(default_factory=list)
    prompt_positions: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(q for _, q in self.rows)

    @property
    def wants_logprobs(self) -> bool:
        """Whether a sample reports sampled-token logprobs (``logprobs`` set, 0 included):
        the step computes them (``SamplingInputs.logprobs_wanted``) and reads them back."""
        return any(seq.params.logprobs is not None for seq, _ in self.samples)


@dataclasses.dataclass
class StepResult:
    """What the device step returned, on the host (row ``i`` of ``plan.rows``, sample ``j``
    of ``plan.samples``).

    Attributes:
      state: the block state the step returned (the allocator's ``append`` and ``commit``
        ran in it); the block manager adopts it.
      num_free_blocks: its free-block count.
      row_ok: ``bool[R]`` whether row ``i`` got its blocks (always, unless a bug).
      tokens: ``i32[R]`` sampled token ``j``.
      logprob: ``f32[R]`` its log-probability, or None when no sample asked for logprobs.
      top_ids, top_logprobs: ``[R, K]`` the top-K candidates, or None (as ``logprob``).
      prompt_logprob, prompt_top_ids, prompt_top_logprobs, prompt_rank: entry ``k`` of
        ``plan.prompt_positions``: ``f32[P]``, ``i32[P, K]``, ``f32[P, K]``, ``i32[P]`` (the
        token's rank, 1 = most likely); None when the plan has none.
      failed_requests: requests whose host work for this step raised (preparing their
        sampling inputs): they fail, the others go on.
      steps: ``i32[R]`` for a multi-step decode (:mod:`paxcache.decode_loop`): iterations
        row ``i`` ran; ``tokens``, ``logprob``, ``top_ids``, ``top_logprobs`` then hold one
        entry per iteration first (``[K, R, ...]``). None for one step.
    """

    state: object
    num_free_blocks: int
    row_ok: np.ndarray
    tokens: np.ndarray
    logprob: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    prompt_logprob: np.ndarray | None = None
    prompt_top_ids: np.ndarray | None = None
    prompt_top_logprobs: np.ndarray | None = None
    prompt_rank: np.ndarray | None = None
    failed_requests: Collection[str] = ()
    steps: np.ndarray | None = None

    def iterations(self) -> list[tuple[np.ndarray, StepResult]]:
        """``(ran bool[R], this iteration's result)`` per iteration of the step: one for a
        single step (``ran`` is ``row_ok``), ``max(steps)`` for a multi-step decode."""
        if self.steps is None:
            return [(np.asarray(self.row_ok, bool), self)]

        def at(x: np.ndarray | None, k: int) -> np.ndarray | None:
            return None if x is None else x[k]

        steps = np.asarray(self.steps)
        return [
            (
                steps > k,
                dataclasses.replace(
                    self,
                    tokens=self.tokens[k],
                    logprob=at(self.logprob, k),
                    top_ids=at(self.top_ids, k),
                    top_logprobs=at(self.top_logprobs, k),
                    steps=None,
                ),
            )
            for k in range(int(steps.max(initial=0)))
        ]


def record_prompt_logprobs(plan: StepPlan, result: StepResult, failed: dict) -> None:
    """Records the prompt log-probabilities a step computed (``plan.prompt_positions``) in
    each sequence; a recomputed prompt overwrites its entries with the same values. A
    request whose values cannot be recorded is added to ``failed``; the others go on."""
    for k, (i, p) in enumerate(plan.prompt_positions):
        seq = plan.rows[i][0]
        if not result.row_ok[i] or seq.request_id in failed:
            continue
        try:
            top_ids, top_lps = result.prompt_top_ids[k], result.prompt_top_logprobs[k]
            seq.prompt_logprobs[p + 1] = {
                "token_id": seq.token_ids[p + 1],
                "logprob": float(result.prompt_logprob[k]),
                "rank": int(result.prompt_rank[k]),
                "top": [
                    (int(top_ids[t]), float(top_lps[t])) for t in range(seq.params.prompt_logprobs)
                ],
            }
        except Exception:  # noqa: BLE001 - this request fails, the others go on
            logger.exception("request %s failed recording prompt logprobs", seq.request_id)
            failed[seq.request_id] = None
