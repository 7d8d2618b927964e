"""The engine's compiled step does no work for nothing: a step without copy-on-write pairs runs
no op over the KV cache for them.

The copy path sits under a ``lax.cond`` on "any pair" (``kernels_pallas.kv_ops.copy_pages``),
so in the optimised HLO every KV-sized op of the copy is inside a conditional's branch, and the
ops over KV-sized tensors outside any conditional are exactly those of the same step built
with no copy path at all. (Swaps run outside the step, only for a plan that has them;
prompt-logprob rows are a program of their own, ``StepInputs.prompt_logprobs is None``
otherwise.) The tokens the engine produces with copies are checked in tests/test_engine.py.
"""

from __future__ import annotations

import collections
import re

import pytest
from tiny_models import byte_llama

from kernels_pallas import kv_layout
from paxcache import Engine, compile_check, kv_cache
from paxcache.models import ByteTokenizer

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_REFS = re.compile(
    r"\b(calls|to_apply|body|condition|branch_computations|true_computation|false_computation)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)
_BRANCHES = ("branch_computations", "true_computation", "false_computation")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s([\w\-]+)\(")
# Ops that only name or pass buffers along (no data moves).
_PLUMBING = {"parameter", "get-tuple-element", "tuple", "bitcast", "conditional"}


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
        elif line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    return comps, entry


def _kv_ops(hlo: str, shape: str) -> tuple[collections.Counter, collections.Counter]:
    """Opcodes whose result has ``shape``: ``(outside any conditional, inside a branch)``,
    following every called computation (fusions, loops, reductions) from the entry."""
    comps, entry = _computations(hlo)
    found = {False: collections.Counter(), True: collections.Counter()}
    seen: set[tuple[str, bool]] = set()
    todo = [(entry, False)]
    while todo:
        name, in_branch = todo.pop()
        if (name, in_branch) in seen:
            continue
        seen.add((name, in_branch))
        for line in comps[name]:
            for kind, names in _REFS.findall(line):
                for callee in names.strip("{}").split(","):
                    if callee.strip():
                        todo.append((callee.strip().lstrip("%"), in_branch or kind in _BRANCHES))
            m = _OP.match(line)
            if m and shape in m.group(1):
                found[in_branch][m.group(2)] += 1
    return found[False], found[True]


@pytest.fixture(scope="module")
def model():
    return byte_llama()


def _step_hlo(model) -> str:
    engine = Engine(
        model, ByteTokenizer(), num_blocks=64, block_size=16, max_num_seqs=4,
        max_num_batched_tokens=16, warmup=False,
    )  # fmt: skip
    return compile_check.lower_step(engine, 16).compile().as_text()


# [L, K, N, S, D] of the engine's cache: 2 layers, 2 kv heads, 64 blocks of 16, head_dim 16.
# The engine's cache: [L, N, S, C, P, D] (kernels_pallas.kv_layout) of 2 layers, 64 blocks of
# 16 tokens, 2 kv heads, head_dim 16, float32.
KV = "f32[{}]".format(",".join(map(str, kv_layout.page_shape(2, 64, 16, 2, 16, "float32"))))


def test_copy_on_write_copies_sit_in_a_conditional_and_cost_nothing_without_pairs(
    model, monkeypatch
):
    outside, inside = _kv_ops(_step_hlo(model), KV)
    moves = {op: n for op, n in inside.items() if op not in _PLUMBING}
    assert moves, f"no KV-sized op inside a conditional: the copy is not under a cond {inside}"
    assert outside["conditional"] >= 1

    monkeypatch.setattr(kv_cache, "apply_copies", lambda kv, *args, **kwargs: kv)
    bare, _ = _kv_ops(_step_hlo(model), KV)
    assert {op: n for op, n in outside.items() if op not in _PLUMBING} == {
        op: n for op, n in bare.items() if op not in _PLUMBING
    }, "the step runs KV-sized ops outside a conditional that a step without copies lacks"
