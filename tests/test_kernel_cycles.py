"""scripts/kernel_cycles.py: the bundle-dump parser, the cycle arithmetic and (TPU gate) a run.

The synthetic dump below follows libtpu's ``*-final_bundles.txt`` format: a guard branch that
skips a loop, the loop (``LB`` marker, one ``>`` per depth) whose body holds a predicated
region of DMA starts and an MXU op, a back edge with four delay slots, and a bundle whose
comment spans lines. The end-to-end test compiles with libtpu (``.ci/tpu_compile.sh``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "kernel_cycles.py"
_spec = importlib.util.spec_from_file_location("kernel_cycles", SCRIPT)
kc = importlib.util.module_from_spec(_spec)
sys.modules["kernel_cycles"] = kc
_spec.loader.exec_module(kc)
bd = sys.modules["bundle_dump"]  # the parser, imported by the script from its folder
kt = sys.modules["kernel_trips"]  # the trip-count models, likewise

DUMP = """= control target key start
LH: loop header
LB: loop body
LE: loop exit
PB: predicated region body
PF: predicated region fallthrough
CT: control target
= control target key end

     0   :  { %s1_s0 = smov 0  ;;  %s2_s1 = inlined_call_operand.hbm [shape: s32[8]] }
   0x1   :  { %3 = sbr.rel (%p0_p0) target = $region9 }
   0x2   :  {}
   0x3   :  {}
   0x4   :  {}
   0x5   :  {} /* End region 1 */
   0x6 LB: > { %s4_s2 = sadd.s32 1, %s1_s0 } /* Start region 5 :: Start region 7 */
   0x7   : > { %5 = sbr.rel (%p1_p1) target = $region6 }
   0x8   : > {}
   0x9   : > {}
   0xa   : > {}
   0xb   : > { %s6_s3 = sld [smem:[#allocation2]] }
   0xc   : > { %7 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s6_s3, /*size_in_granules=*/1024 }
   0xd   : > { %8 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s6_s3, /*size_in_granules=*/1024 }
   0xe PF: > { %v9_v0 = vmatmul.bf16.vlgmr.msra.gmra.mxu0 %v1_v1 } /* Start/End empty region 6 */
   0xf   : > { %10 = sbr.rel (!%p2_p2) target = $region5 }
  0x10   :  {}
  0x11   :  {}
  0x12   :  {}
  0x13   :  { %11 = dma.done.wait [#allocation3], 16 /* note
hlo: kernel.1
 */ }
  0x14 PF:  { %12 = vst [vmem:[#allocation4] sm:$0xff] %v9_v0 } /* Start/End empty region 9 */
  0x15   :  { %13 = vsyncadd [#allocation3], 4294967280 }
"""


@pytest.fixture(scope="module")
def dump() -> kc.Dump:
    return kc.parse_dump(DUMP, "kernel")


def test_parse_bundles_reads_addresses_depths_markers_and_multiline_comments():
    bundles = bd.parse_bundles(DUMP)
    assert [b.addr for b in bundles] == list(range(0x16))
    assert bundles[6].marker == "LB" and bundles[6].depth == 1
    assert bundles[0x10].depth == 0 and bundles[0x10].empty
    assert "hlo: kernel.1" in bundles[0x13].text


def test_back_edge_makes_a_loop_spanning_its_delay_slots(dump):
    assert dump.delay == 4
    (loop,) = dump.loops
    assert (loop.start, loop.end, loop.span) == (6, 0x13, 14)
    assert loop.mxu and not loop.children
    assert dump.summary() == [[14, []]]


def test_forward_branch_makes_regions_and_a_guard_owned_by_the_parent(dump):
    (loop,) = dump.loops
    (region,) = loop.regions
    assert (region.start, region.end, region.dma_start, region.dma_wait) == (0xC, 0xE, True, False)
    (guard,) = dump.regions
    assert (guard.start, guard.end) == (6, 0x14) and guard.loops == [loop]


# TPU7x: 3 delay slots, and a loop's guard whose delay slots hold the loop's first bundle.
GUARD_IN_DELAY_SLOTS = """     0   :  { %s1_s0 = smov 0 }
   0x1   :  { %3 = sbr.rel (%p0_p0) target = $region9 }
   0x2   :  {}
   0x3   :  {}
   0x4 LB: > { %s4_s2 = sadd.s32 1, %s1_s0 } /* Start region 5 */
   0x5   : > { %v9_v0 = vmatmul.bf16.vlgmr.msra.gmra.mxu0 %v1_v1 }
   0x6   : > { %10 = sbr.rel (!%p2_p2) target = $region5 }
   0x7   : > {}
   0x8   : > {}
   0x9   : > {} /* End region 5 */
   0xa PF:  { %s5_s3 = smov 1 } /* Start/End empty region 9 */
   0xb   :  { %11 = sbr.rel (%p3_p3) target = $region11 }
   0xc   :  {}
   0xd   :  {}
   0xe   :  {}
   0xf PF:  { %s6_s4 = smov 2 } /* Start/End empty region 11 */
"""


def test_a_guard_whose_delay_slots_hold_the_loops_first_bundle_is_the_parents():
    """The guard's region starts after the loop's first bundle, yet its branch is outside the
    loop: it guards the loop (owned by the parent), it is not a region of every iteration."""
    dump = bd.parse_dump(GUARD_IN_DELAY_SLOTS, "kernel")
    assert dump.delay == 3
    (loop,) = dump.loops
    assert (loop.start, loop.end) == (4, 9) and loop.regions == []
    (guard,) = dump.regions
    assert (guard.start, guard.end) == (5, 0xA) and guard.loops == [loop]
    assert bd.iteration_cycles(loop, lambda _: None, lambda *_: 0.0) == loop.span


def test_iteration_cycles_weighs_regions_by_the_fraction_that_runs(dump):
    (loop,) = dump.loops
    assert bd.iteration_cycles(loop, lambda _: None) == 14
    assert bd.iteration_cycles(loop, lambda _: None, lambda *_: 0.0) == 12
    assert bd.iteration_cycles(loop, lambda _: None, lambda *_: 0.5) == 13


NESTED = """     0   :  { %s1_s0 = smov 0 }
   0x1   :  { %2 = sbr.rel (%p0_p0) target = $region20 }
   0x2   :  {}
   0x3   :  {}
   0x4   :  {}
   0x5   :  {} /* End region 2 */
   0x6   :  { %v3_v0 = vadd.f32 %v1_v1, %v1_v1 }
   0x7   :  { %4 = sbr.rel (%p1_p1) target = $region21 }
   0x8   :  {}
   0x9   :  {}
   0xa   :  {}
   0xb   :  {} /* End region 3 */
   0xc   :  { %v5_v2 = vmul.f32 %v3_v0, %v3_v0 }
   0xd   :  { %v6_v3 = vmul.f32 %v5_v2, %v5_v2 }
   0xe PF:  {} /* Start region 21 */
   0xf   :  {}
  0x10 PF:  { %7 = vst [vmem:[#allocation4] sm:$0xff] %v6_v3 } /* Start region 20 */
"""


def test_a_region_inside_a_region_is_nested_and_weighed_within_it():
    nested = kc.parse_dump(NESTED, "kernel")
    (outer,) = nested.regions
    (inner,) = outer.regions
    assert (outer.start, outer.end, inner.start, inner.end) == (6, 0x10, 0xC, 0xE)
    root = kt._unit_loop(nested)

    def cost(w_outer: float, w_inner: float) -> float:
        return bd.iteration_cycles(
            root, lambda _: None, lambda _lp, rg: w_outer if rg is outer else w_inner
        )

    assert cost(1.0, 1.0) == 17
    assert cost(1.0, 0.0) == 15  # the inner region's 2 bundles skipped
    assert cost(1.0, 0.25) == 15.5
    assert cost(0.5, 1.0) == 12  # the inner one runs at most as often as the outer one
    assert cost(0.0, 1.0) == 7


def test_program_cost_is_straight_code_plus_trips_and_skips_a_zero_trip_guard(dump):
    root = kt._unit_loop(dump)
    (loop,) = dump.loops
    assert bd.iteration_cycles(root, lambda c: 3 * 14 if c is loop else None) == 22 - 14 + 42
    assert bd.iteration_cycles(root, lambda _: None) == 8  # 0x0-0x5 and 0x14-0x15


def test_a_step_dma_region_holding_a_copy_loop_is_skipped_on_the_last_step():
    # The fused decode kernel's next-step region: DMA starts plus the new row's vector copy
    # loop (no MXU op). It runs on every step but the last, like the unfused kernel's.
    copy = bd.Loop(12, 18)  # no MXU ops
    next_step = bd.Region(10, 30, dma_start=True, loops=[copy])
    unmasked, masked = bd.Region(30, 60), bd.Region(60, 100)
    guard = bd.Region(0, 5, loops=[bd.Loop(0, 4)])  # a loop's guard (no DMA) is no body
    step = bd.Loop(0, 100, [copy], [guard, next_step, unmasked, masked], mxu=True)
    dmas, _, bodies, _ = kt._step_regions(step, finishes=False)
    assert dmas == [next_step] and bodies == [unmasked, masked]
    step.regions.remove(guard)
    last = kt._step_weight(step, False, True, True, finishes=False)
    other = kt._step_weight(step, False, False, True, finishes=False)
    trips = lambda _: bd.iteration_cycles(copy, lambda _: None)  # noqa: E731
    assert bd.iteration_cycles(step, trips, last) == 101 - 20 - 40
    assert bd.iteration_cycles(step, trips, other) == 101 - 40
    # a region whose loop holds MXU ops (an older kernel's head loop) is no DMA region
    heads = bd.Loop(12, 18, mxu=True)
    step = bd.Loop(0, 100, [heads], [bd.Region(10, 30, dma_start=True, loops=[heads])], True)
    assert kt._step_regions(step, finishes=False)[0] == []


def test_find_dumps_maps_kernel_names_to_final_bundles(tmp_path):
    for f in ("17-paxcache_ragged_paged_attention.1-72-final_bundles.txt",
              "17-paxcache_ragged_paged_attention.1-71-schedule-analysis_final_bundles.txt",
              "18-RPAd-p_16-bq_1_1-bkv_4096_4096.1-72-final_bundles.txt"):  # fmt: skip
        (tmp_path / f).write_text(DUMP)
    found = kc.find_dumps(str(tmp_path))
    assert sorted(found) == ["RPAd-p_16-bq_1_1-bkv_4096_4096", "paxcache_ragged_paged_attention"]


def test_ceilings_divide_work_time_by_static_time_and_cap_at_one():
    # 1 MiB at 1 GB/s over 1e6 cycles at 1 GHz: 1.048576 ms of bytes in 1 ms -> capped.
    c = kc.ceilings(1e6, 2**20, 5e8, clock=1e9, bw=1e9, peak=1e12)
    assert c["cycles_per_kib"] == pytest.approx(1e6 / 1024)
    assert c["hbm_ceiling"] == 1.0
    assert c["bundles_per_useful_flop"] == pytest.approx(2e-3)
    assert c["mxu_ceiling"] == pytest.approx(0.5)  # 0.5 ms of flops in 1 ms


@given(q=st.integers(1, 300), extra=st.integers(0, 300))
def test_causal_pairs_counts_every_visible_key_of_every_row(q, extra):
    ctx = q + extra
    assert kc.causal_pairs(q, ctx) == sum(ctx - q + i + 1 for i in range(q))


def test_case_work_counts_logical_kv_bytes_and_useful_flops():
    a = kc.build_parser().parse_args(["--batch=4", "--ctx=256", "--chunk=64"])
    per = 256 * 8 * 2 * 128 * 2
    assert kc.case_work("decode", a) == (4, 4 * per, 4 * 256 * 4 * 32 * 128)
    assert kc.case_work("prefill", a)[1:] == (per, kc.causal_pairs(64, 256) * 4 * 32 * 128)
    assert kc.case_work("mixed", a)[0] == 5


def test_cli_takes_comma_lists_and_rejects_unknown_values():
    a = kc.build_parser().parse_args(["--target=v5e,tpu7x", "--case=decode"])
    assert a.target == ["v5e", "tpu7x"] and a.case == ["decode"]
    with pytest.raises(SystemExit):
        kc.build_parser().parse_args(["--case=train"])
    for sweep in ("1024,512", "1024,1024,60,16,120,32,9", "1024,x,60"):  # 3 to 6 numbers
        with pytest.raises(SystemExit):
            kc.main(["--target=v5e", "--case=prefill", f"--ragged-blocks={sweep}"])


def test_search_trips_follow_the_kernels_binary_search():
    cu = list(range(65))  # 64 one-row sequences
    assert kt._search_trips(cu, 64, 0) == 7  # hi: 64, 32, ..., 1, 0
    assert kt._search_trips([0, 8], 1, 0) == 1


def test_kv_read_counts_each_query_blocks_visible_pages():
    """A 2048-token chunk at ctx 2048 in 128-token query blocks re-reads the context up to
    each block's last row (128 * (1 + ... + 16) keys); RPA v3's 256-token blocks half as often;
    a decode reads its sequence's pages once; a mixed batch's decodes are not the ragged
    kernel's."""
    meta = dict(tq=128, page=16, max_blocks=128)
    assert kt.paxcache_ragged_read_keys(meta, [2048], 2048) == 128 * 136
    assert kt.paxcache_ragged_read_keys(meta, [1, 1, 2048], 2048, first_seq=2) == 128 * 136
    rpa = dict(bq_sz=256, page=16, static_q_len=True)
    assert kt.rpa_read_keys(rpa, [2048], 2048) == 256 * 36
    assert kt.rpa_read_keys(dict(rpa, static_q_len=False), [1], 100) == 112  # 100 keys: 7 pages
    assert kt.paxcache_paged_read_keys(dict(page=16), [4096, 10, 0]) == 4096 + 16


@pytest.mark.slow
def test_kernel_cycles_end_to_end_v5e_decode(tmp_path):
    pytest.importorskip("libtpu")
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(SCRIPT), "--target=v5e", "--case=decode", "--batch=4",
           "--ctx=256", f"--json={out}"]  # fmt: skip
    wheel = os.environ.get("RPA_WHEEL")
    if wheel:
        cmd.append(f"--rpa-wheel={wheel}")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())
    names = {row["name"] for row in rows if row["kernel"] == "paxcache"}
    assert names == {"paxcache_paged_decode_attention"}  # both ops: the decode kernel
    for row in rows:
        assert row["cycles_per_kib"] > 0 and 0 < row["hbm_ceiling"] <= 1
        assert 0 < row["mxu_ceiling"] <= 1


def test_a_failed_compile_names_the_memory_it_overflowed():
    smem = "Allocation (size=2097152) would exceed memory (size=1048576) :: #a [space=smem, size"
    assert kc._compile_verdict(smem) == "smem exceeded: 2.0 MiB asked, 1.0 MiB there"
    vmem = "x Ran out of memory in memory space vmem. Used 67.6M of 64.0M vmem. y"
    assert (
        kc._compile_verdict(vmem)
        == "Ran out of memory in memory space vmem. Used 67.6M of 64.0M vmem."
    )
    hbm = "RESOURCE_EXHAUSTED: Ran out of memory on HBM, 16.00G of 15.75G\nTraceback"
    assert kc._compile_verdict(hbm) == "Ran out of memory on HBM, 16.00G of 15.75G"
    assert kc._compile_verdict("some other failure") == ""
