"""The engine under memory pressure (issue 13)."""

from __future__ import annotations

import numpy as np
import pytest

from paxcache import Engine, SamplingParams


@pytest.fixture(scope="module")
def tiny():
    from paxcache.models import load_pretrained

    return load_pretrained("tiny")


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_swap_preemption_does_not_livelock(tiny, mode):
    # Issue 13: four requests whose KV needs exceed the 40 device blocks. In swap mode the
    # scheduler swapped the newest sequence out and straight back in within one step, forever
    # (thousands of swaps, no request finished). The step cap is the progress bound.
    model, tok = tiny
    eng = Engine(
        model,
        tok,
        num_blocks=40,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=384,
        preemption_mode=mode,
        num_host_blocks=256 if mode == "swap" else 0,
    )
    rng = np.random.default_rng(13)
    lens = (19, 120, 200, 249)
    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    for i, n in enumerate(lens):
        eng.add_request(f"r{i}", list(map(int, rng.integers(0, 256, n))), sp)
    cap = sum(n + sp.max_tokens for n in lens)
    finished = {}
    for _ in range(cap):
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
        if not eng.has_unfinished_requests():
            break
    st = eng.stats()
    assert len(finished) == len(lens), (
        f"{len(finished)} of {len(lens)} requests finished in {cap} steps; "
        f"preemptions {st['num_preemptions']}, swaps {st['num_swaps']}"
    )
    assert all(len(o.outputs[0].token_ids) == sp.max_tokens for o in finished.values())
    assert st["num_preemptions"] > 0
    assert st["num_free_blocks"] == st["num_total_blocks"]
