"""Trip-count models of ``scripts/kernel_cycles.py``: the static cycles of each kernel's dump.

The cost of one loop iteration (``bundle_dump.iteration_cycles``) is its span, minus nested
loops' spans plus their trip counts times their own iteration cost, minus the skipped share of
each region: a region holding a loop of zero trips is skipped, other regions get a weight (the
fraction of iterations that execute them) from the kernel's model below.

Trip counts (derived from the dump's loop tree, the kernel's block sizes and the shape; every
sequence has ``ctx`` keys; a "program" is one grid step, which Mosaic compiles as the
outermost loop of the kernel, so its trips are the grid size):

* ``paxcache_ragged_paged_attention`` (``kernels_pallas.ragged_paged_attention``, grid
  ``T_pad / TQ``, ``TQ = default_queries_per_block``, ``P = default_pages_per_compute_block``
  pages of ``S`` keys per step, ``C = P * S``, block sizes per chip from
  ``ragged_blocks(device_kind)``): in a program, the top-level loops are the
  binary search on ``cu_q_lens`` (trips simulated exactly), ``skip_empty`` loops (0 trips:
  every sequence has rows) and the work-item loop (the one holding the MXU ops). A sequence
  overlapping the block with last row at position ``pos_hi`` takes
  ``n = ceil(min(ceil((pos_hi + 1) / S), M) / P)`` work items, each costed on its own path: the
  region that starts the next step's KV DMAs without waiting runs on all but the last item;
  the next sequence's table row and pages (DMAs and a wait) and every other DMA-free region
  after the two step bodies (finishing the output, row prefetch) on the last; of the two step
  bodies (``pl.when(whole)`` / ``pl.when(~whole)``: the first two DMA-free regions, the smaller
  one unmasked) the unmasked one runs when every row of the block is the sequence's and the
  step's last key is at or below the block's first row (``whole``, as the kernel computes
  it), the masked one otherwise; inside the masked body one nested region per compiled
  width (``masked_step_widths``, narrowest first) runs: the narrowest holding the step's
  pages up to the block's last row (``end_page - i * P``; no window). Kernels with a head
  loop (the nested loop with MXU ops) run it ``K`` trips; unrolled heads need none.
  Sequences below ``first_seq`` (a mixed batch's leading decodes, which the decode kernel
  takes) have no work items, and their rows are moved out of the kernel's query blocks (the
  wrapper rolls the queries up by ``cu_q_lens[first_seq]`` rows: the blocks start at the first
  sequence of the kernel's own); a program with no sequence of its own skips its work loop.
* ``paxcache_paged_decode_attention`` (``kernels_pallas.paged_attention``; also the TPU path of
  a decode-only ``ragged_paged_attention(max_q_len=1)``), grid ``(2, B/2)``, one program per
  sequence: the step loop (the MXU loop inside the grid loop) runs
  ``n = ceil(ceil(ctx / S) / P)`` trips with ``P = decode_pages_per_step``; step ``i`` runs the
  next-step DMA region unless it is the last, and the unmasked body when
  ``(i + 1) * P * S <= ctx``, else the masked one. The DMA-issue loops (nested loops without
  MXU ops: one page's copy per trip, K and V of every kv head in one descriptor; the kernel
  unrolls its copies, so a libtpu that keeps them unrolled compiles none) run one trip per
  page copied: in step ``i`` ``min(P, ceil(ctx / S) - (i + 1) * P)`` (the next step's
  pages), in the program body ``min(P, ceil(ctx / S))`` (the first step's). Each program is
  costed at its own length: a length-0 row (a mixed batch's prefill rows, padding) runs
  neither.
* A mixed batch through ``ragged_paged_attention``: the decode kernel on the leading decode
  rows (``min(T, B)`` programs, the rest length 0) plus the ragged kernel from
  ``first_seq`` = the number of decode rows; the row sums them.
* RPA v3 (``ragged_paged_attention`` of tpu-inference, default block sizes
  ``(bq, bkv, bq_c, bkv_c)`` from ``get_default_block_sizes``; grid (1,)): its decode kernel
  (``RPAd-*``) takes the decode rows, its prefill kernel (``RPAp-*``, ``static_q_len = chunk``)
  the chunk (the mixed case runs both; the row sums them). The sequence loop runs once per
  sequence of the kernel; the query-block loop ``ceil(q_len / bq)`` trips (absent when that is
  statically 1); for query block ``i`` the KV-block loop ``ceil(min(ctx, gap + (i + 1) * bq) /
  bkv)`` trips (``gap = ctx - q_len``), and in KV block ``j`` the compute loop (the loop with
  MXU ops) ``ceil(min(eff - j * bkv, bkv) / bkv_c)`` (``eff`` the block's visible length); the
  KV-cache update loop (a nested loop without MXU ops) runs over the pages the block's new
  tokens touch on the last query block and is skipped otherwise. Regions of the sequence loop
  before its first nested loop that start DMAs (the prologue: first sequence only) and after
  its last one (the epilogue: last sequence only) have weight 0; all other regions weight 1.

KV bytes read (the ``*_read_keys`` functions below, times ``K * 2 * D * itemsize`` per key):
the keys each kernel brings into VMEM, page-rounded, whether from the pages or (fused write)
from the step's new rows: the decode kernel ``ceil(ctx / S) * S`` per sequence; the ragged
kernel, for every (query block, sequence with rows in it), the pages up to the block's last
row (``end_page * S``); RPA v3, for every query block ``i`` of a sequence, its visible length
``min(ctx, gap + (i + 1) * bq)`` page-rounded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bundle_dump import Dump, Loop, Region, iteration_cycles


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _mxu_child(loop: Loop) -> Loop | None:
    return next((c for c in loop.children if c.mxu or _mxu_child(c)), None)


def _unit_loop(dump: Dump, programs: int = 1) -> Loop:
    """The loop of one program: Mosaic compiles a grid of more than one step as the kernel's
    outermost loop (the top-level loop holding the MXU ops); a one-step grid has none, and the
    whole kernel is then one program (a virtual loop over every bundle, run once)."""
    if programs > 1:
        return next(lp for lp in dump.loops if lp.mxu)
    return Loop(0, len(dump.bundles) - 1, list(dump.loops), list(dump.regions), True)


def _search_trips(cu: Sequence[int], nseq: int, r0: int, lo: int = 0) -> int:
    hi, n = nseq, 0
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cu[mid + 1] > r0 else (mid + 1, hi)
        n += 1
    return n


def _step_regions(loop: Loop, finishes: bool = True) -> tuple[list, list, list, list]:
    """A step loop's plain regions: ``(next step's DMAs, next sequence's DMAs, [unmasked,
    masked] bodies, once per sequence)``. The two bodies are ``pl.when(whole)`` /
    ``pl.when(~whole)`` alternatives: the first two regions without DMAs (the masked one is
    the larger). ``finishes``: the loop also finishes sequences (the ragged kernel): bodies
    only when there are more than two DMA-free regions, the others finish a sequence; the
    decode kernel's step loop (``finishes=False``) has the two bodies and nothing else.
    A region of DMA starts holding loops without MXU ops is plain too: the fused decode
    kernel's new-row copy (a vector load/store loop, ``kv_new`` being in VMEM) sits inside
    the next step's DMA region, which still runs on every step but the last."""

    def plain_region(r: Region) -> bool:
        return not r.loops or (r.dma_start and not any(lp.mxu or _mxu_child(lp) for lp in r.loops))

    plain = [r for r in loop.regions if plain_region(r)]
    step = [r for r in plain if r.dma_start and not r.dma_wait]
    seq = [r for r in plain if r.dma_start and r.dma_wait]
    rest = [r for r in plain if not r.dma_start]
    bodies = sorted(rest[:2], key=lambda r: r.span) if len(rest) > (2 if finishes else 1) else []
    once = [r for r in rest if r not in bodies]
    return step, seq, bodies, once


def _step_weight(
    loop: Loop, first: bool, last: bool, whole: bool, width: int = 0, widths: Sequence[int] = (),
    finish: tuple[bool, bool] | None = None, finishes: bool = True,
) -> Callable:  # fmt: skip
    step, seq, bodies, once = _step_regions(loop, finishes)
    if finish is not None and len(once) == 1 and len(once[0].regions) == 3:
        # the finish region's stores (the whole block, or the sequence's rows) and the reset
        # for a next sequence
        block_is_mine, more = finish
        store_block, store_rows, reset = sorted(once[0].regions, key=lambda r: r.start)
        finish_weights = {
            id(store_block): float(block_is_mine), id(store_rows): float(not block_is_mine),
            id(reset): float(more),
        }  # fmt: skip
    else:
        finish_weights = {}
    # the masked body's variants, one nested region per compiled width (narrowest first)
    variant: dict[int, float] = {}
    if len(widths) > 1 and bodies:
        nested = sorted(bodies[1].regions, key=lambda r: r.start)
        if len(nested) != len(widths):
            raise RuntimeError(
                f"masked step: {len(nested)} nested regions for widths {list(widths)}"
            )
        variant = {id(r): float(w == width) for r, w in zip(nested, widths, strict=True)}

    def weight(lp: Loop, rg: Region) -> float:
        if lp is not loop:
            return 1.0
        if id(rg) in variant:
            return variant[id(rg)]
        if id(rg) in finish_weights:
            return finish_weights[id(rg)]
        if rg in step:
            return 0.0 if last else 1.0
        if rg in seq or rg in once:
            return 1.0 if last else 0.0
        if bodies and rg is bodies[0]:
            return 1.0 if whole else 0.0
        if bodies and rg is bodies[1]:
            return 0.0 if whole else 1.0
        return 1.0

    return weight


def paxcache_ragged_cycles(
    dump: Dump, meta: dict, q_lens: Sequence[int], ctx: int, first_seq: int = 0
) -> float:
    """Static cycles of ``paxcache_ragged_paged_attention`` for sequences of ``q_lens`` rows,
    the first ``first_seq`` of them left to the decode kernel (skipped: no work items)."""
    tq, p, s, kh = meta["tq"], meta["pages_per_step"], meta["page"], meta["kv_heads"]
    m = meta["max_blocks"]
    widths = meta.get("masked_widths", [p])  # a masked step's compiled widths, in pages
    keys = p * s
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    programs = _cdiv(cu[-1], tq)  # the grid covers every row
    shift = cu[min(first_seq, len(q_lens))]  # the skipped sequences' rows are moved out
    cu = [c - shift for c in cu]
    grid = _unit_loop(dump, programs)
    work = next(c for c in grid.children if c.mxu)
    head = _mxu_child(work)  # a head loop (older kernels) or unrolled heads (None)
    search = grid.children[0] if grid.children[0] is not work else None
    search_iter = iteration_cycles(search, lambda c: None) if search else 0.0
    head_total = kh * iteration_cycles(head, lambda _: None) if head else 0.0

    def nested_work(c: Loop) -> float | None:
        return head_total if c is head else None  # skip_empty loops: 0 trips

    total = 0.0
    for qb in range(programs):
        r0, r1 = qb * tq, qb * tq + tq
        work_cost = 0.0
        busy = False
        for sq, q in enumerate(q_lens):
            lo, hi = max(cu[sq], r0), min(cu[sq + 1], r1)
            if hi <= lo or sq < first_seq:
                continue
            busy = True
            off = ctx - q - cu[sq]
            n = _cdiv(min((hi - 1 + off + s) // s, m), p)
            end_page = min((hi - 1 + off + s) // s, m)
            for i in range(n):
                whole = lo == r0 and hi == r1 and i * keys + keys - 1 <= lo + off
                need = end_page - i * p  # the masked step runs the narrowest width holding it
                width = next((w for w in widths if need <= w), p)
                more = any(  # a later sequence with rows in this block follows this one
                    max(cu[x], r0) < min(cu[x + 1], r1) for x in range(sq + 1, len(q_lens))
                )
                finish = (lo == r0 and hi == r1, more)
                w = _step_weight(work, i == 0, i == n - 1, whole, width, widths, finish)
                work_cost += iteration_cycles(work, nested_work, w)
        n_search = _search_trips(cu, len(q_lens), r0, min(first_seq, len(q_lens)))

        def nested(
            c: Loop, w: float = work_cost, ns: int = n_search, busy: bool = busy
        ) -> float | None:
            if c is work:
                return w if busy else None  # a program with no sequence of its own
            if c is search:
                return ns * search_iter if ns else None
            return None  # skip_empty: every sequence has rows

        total += iteration_cycles(grid, nested)
    return total


def paxcache_paged_cycles(dump: Dump, meta: dict, lengths: Sequence[int]) -> float:
    """Static cycles of ``paxcache_paged_decode_attention``: one program per row of
    ``lengths`` (0 = a padding row: no steps, no copies), rows padded to the two halves."""
    p, s, kh = meta["pages_per_step"], meta["page"], meta["kv_heads"]
    rows = len(lengths)
    programs = 2 * _cdiv(rows, 2) if rows >= 2 else 1
    lengths = list(lengths) + [0] * (programs - rows)
    grid = _unit_loop(dump, programs)
    step = _mxu_child(grid)
    head = _mxu_child(step)  # a head loop (older kernels) or unrolled heads (None)
    head_total = kh * iteration_cycles(head, lambda _: None) if head else 0.0

    def copies(c: Loop, count: int) -> float | None:
        """A DMA-issue loop (no MXU ops) copying ``count`` pages: one trip per page. With
        the fused KV write, the only such loop is the new row's copy into the KV buffer
        (XLA puts the small ``kv_new`` in VMEM, so that copy is a vector load/store loop
        over its rows): one trip, a decode row's one token."""
        if meta.get("fused"):
            return iteration_cycles(c, lambda _: None)
        return count * iteration_cycles(c, lambda _: None) if count > 0 else None

    def program(ctx: int) -> float:
        pages = _cdiv(ctx, s)
        n = _cdiv(pages, p)
        step_total = 0.0
        for i in range(n):
            whole = (i + 1) * p * s <= ctx
            w = _step_weight(step, i == 0, i == n - 1, whole, finishes=False)
            nxt = min(p, pages - (i + 1) * p)  # the next step's pages, issued in this one

            def in_step(c: Loop, nxt: int = nxt) -> float | None:
                return head_total if c is head else copies(c, nxt)

            step_total += iteration_cycles(step, in_step, w)

        def in_program(c: Loop) -> float | None:
            if c is step:
                return step_total if n else None
            return copies(c, min(p, pages))  # the first step's

        return iteration_cycles(grid, in_program)

    cost = {ctx: program(ctx) for ctx in set(lengths)}
    return sum(cost[ctx] for ctx in lengths)


def rpa_cycles(dump: Dump, meta: dict, q_lens: Sequence[int], ctx: int) -> float:
    """Static cycles of one RPA v3 kernel (grid (1,)) for its sequences of ``ctx`` keys."""
    bq, bkv, bkv_c, page = meta["bq_sz"], meta["bkv_sz"], meta["bkv_csz"], meta["page"]
    seq = next(lp for lp in dump.loops if lp.mxu)  # grid (1,): the sequence loop is top-level
    chain = [seq]
    while (c := _mxu_child(chain[-1])) is not None:
        chain.append(c)
    compute = chain[-1]
    bkv_loop = chain[-2]
    bq_loop = chain[-3] if len(chain) >= 4 else None
    compute_iter = iteration_cycles(compute, lambda _: None)
    first = min((c.start for c in seq.children), default=seq.end)
    last = max((c.end for c in seq.children), default=seq.start)

    def seq_weight(lp: Loop, rg: Region) -> float:
        if rg.loops:
            return 1.0
        if rg.end <= first and rg.dma_start:
            return 0.0  # prologue: the first sequence only
        return 0.0 if rg.start > last else 1.0  # epilogue: the last sequence only

    total = 0.0
    for q in q_lens:
        actual_bq = min(bq, q) if meta["static_q_len"] else bq
        gap = ctx - q
        bq_costs = []
        for i in range(_cdiv(q, actual_bq)):
            eff = min(ctx, gap + (i + 1) * actual_bq)
            bkv_total = 0.0
            for j in range(_cdiv(eff, bkv)):
                n_c = _cdiv(max(min(eff - j * bkv, bkv), 0), bkv_c)
                lo, hi = j * bkv, min((j + 1) * bkv, ctx)
                upd = 0
                if i == _cdiv(q, actual_bq) - 1 and hi > max(lo, gap):
                    upd = _cdiv(hi, page) - max(lo, gap) // page

                def nested(c: Loop, n_c: int = n_c, upd: int = upd) -> float | None:
                    if c is compute:
                        return n_c * compute_iter if n_c else None
                    if not upd:
                        return None
                    return upd * iteration_cycles(c, lambda _: None)  # KV-cache update

                bkv_total += iteration_cycles(bkv_loop, nested)
            if bq_loop is None:
                bq_costs.append(bkv_total)
            else:
                bq_costs.append(
                    iteration_cycles(bq_loop, lambda c, t=bkv_total: t if c is bkv_loop else None)
                )
        inner = bq_loop or bkv_loop
        total += iteration_cycles(
            seq, lambda c, t=sum(bq_costs), x=inner: t if c is x else None, seq_weight
        )
    root = _unit_loop(dump)  # code outside the sequence loop runs once per call
    return iteration_cycles(root, lambda c: total if c is seq else None)


def paxcache_ragged_read_keys(
    meta: dict, q_lens: Sequence[int], ctx: int, first_seq: int = 0
) -> int:
    """Keys ``paxcache_ragged_paged_attention`` reads (module docstring): per (query block,
    sequence with rows in it), the pages up to the block's last row."""
    tq, s, m = meta["tq"], meta["page"], meta["max_blocks"]
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    shift = cu[min(first_seq, len(q_lens))]
    cu = [c - shift for c in cu]
    keys = 0
    for qb in range(_cdiv(cu[-1], tq)):
        r0, r1 = qb * tq, qb * tq + tq
        for sq, q in enumerate(q_lens):
            lo, hi = max(cu[sq], r0), min(cu[sq + 1], r1)
            if hi > lo and sq >= first_seq:
                keys += min((hi - 1 + ctx - q - cu[sq] + s) // s, m) * s
    return keys


def paxcache_paged_read_keys(meta: dict, lengths: Sequence[int]) -> int:
    """Keys ``paxcache_paged_decode_attention`` reads: each sequence's pages."""
    return sum(_cdiv(n, meta["page"]) * meta["page"] for n in lengths)


def rpa_read_keys(meta: dict, q_lens: Sequence[int], ctx: int) -> int:
    """Keys one RPA v3 kernel reads: every query block's visible length, page-rounded."""
    bq, page = meta["bq_sz"], meta["page"]
    keys = 0
    for q in q_lens:
        actual_bq = min(bq, q) if meta["static_q_len"] else bq
        for i in range(_cdiv(q, actual_bq)):
            keys += _cdiv(min(ctx, ctx - q + (i + 1) * actual_bq), page) * page
    return keys
