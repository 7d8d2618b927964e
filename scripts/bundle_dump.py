"""Parse libtpu's ``*-final_bundles.txt`` dumps into loops and predicated regions.

Format: one VLIW bundle per line, ``ADDR MARK: DEPTH { op ;; op } /* comments */`` with
``MARK`` in LB (loop body start), PF (predicated-region fallthrough), ... and ``DEPTH`` one
``>`` per enclosing loop; region comments ``Start region N`` / ``Start/End empty region N``
(a bundle's comment may span lines). A branch is ``sbr.rel (pred) target = $regionN``,
followed by delay-slot bundles (4 on v5e).

A branch whose target region starts at or before it is a loop's back edge: the loop spans the
target bundle through the branch's delay slots. A forward branch skips a *region* (the
bundles after its delay slots up to the target): a ``pl.when`` body, or a loop's guard when
it covers a whole loop (the guard belongs to the loop's parent). Used by
``scripts/kernel_cycles.py``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

_MXU = re.compile(r"\bvmatmul|\bvmatpush|\bvmatprep|\bvmatres")
_DMA_START = re.compile(r"=\s*dma\.(?!done)")
_DMA_WAIT = re.compile(r"dma\.done\.wait")

# --------------------------------------------------------------------------------------------
# Dump parser
# --------------------------------------------------------------------------------------------

_BUNDLE = re.compile(r"^\s*(0x[0-9a-fA-F]+|\d+)\s+(?:(LH|LB|LE|PB|PF|CT):)?\s*:?\s*(>*)\s*\{", re.M)
_BRANCH = re.compile(r"sbr\.rel\b[^;}]*?target\s*=\s*\$region(\d+)")
_START = re.compile(r"Start(?:/End empty)? region (\d+)\b")


@dataclasses.dataclass(frozen=True)
class Bundle:
    """One VLIW bundle: its address, loop depth, marker and text (ops and comments)."""

    addr: int
    depth: int
    marker: str
    text: str

    @property
    def empty(self) -> bool:
        return self.text.split("{", 1)[1].lstrip().startswith("}")


@dataclasses.dataclass
class Loop:
    """Bundles ``[start, end]`` (end = last delay slot of the back edge) and nested loops."""

    start: int
    end: int
    children: list[Loop] = dataclasses.field(default_factory=list)
    regions: list[Region] = dataclasses.field(default_factory=list)
    mxu: bool = False

    @property
    def span(self) -> int:
        return self.end - self.start + 1


@dataclasses.dataclass
class Region:
    """Bundles ``[start, end)`` a forward branch skips; ``loops``: loops inside it;
    ``regions``: the regions nested directly inside it (a ``pl.when`` inside a ``pl.when``)."""

    start: int
    end: int
    dma_start: bool = False
    dma_wait: bool = False
    loops: list[Loop] = dataclasses.field(default_factory=list)
    regions: list[Region] = dataclasses.field(default_factory=list)

    @property
    def span(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class Dump:
    """A parsed kernel: its bundles, top-level loops and top-level regions."""

    name: str
    bundles: list[Bundle]
    loops: list[Loop]
    regions: list[Region]
    delay: int

    def summary(self) -> list[Any]:
        """Nested ``[span, [children...]]`` per top-level loop: the static code's shape."""

        def walk(lp: Loop) -> list[Any]:
            return [lp.span, [walk(c) for c in lp.children]]

        return [walk(lp) for lp in self.loops]


def parse_bundles(text: str) -> list[Bundle]:
    """Split a ``final_bundles`` text into bundles (a bundle's comment may span lines)."""
    ms = list(_BUNDLE.finditer(text))
    out = []
    for i, m in enumerate(ms):
        end = ms[i + 1].start() if i + 1 < len(ms) else len(text)
        out.append(
            Bundle(int(m.group(1), 0), len(m.group(3)), m.group(2) or "", text[m.start() : end])
        )
    return out


def _delay_slots(bundles: list[Bundle], branches: list[int]) -> int:
    """Delay slots after a branch: the usual count of bundles before the next region mark."""
    counts = []
    for b in branches:
        n = 0
        for j in range(b + 1, min(b + 9, len(bundles))):
            if (
                bundles[j].marker
                or _START.search(bundles[j].text)
                or _BRANCH.search(bundles[j].text)
            ):
                break
            n += 1
            if "End region" in bundles[j].text:
                break
        counts.append(n)
    return max(set(counts), key=counts.count) if counts else 0


def parse_dump(text: str, name: str = "") -> Dump:
    """Parse bundles and build the loop tree and the forward-branch regions."""
    bundles = parse_bundles(text)
    starts: dict[int, int] = {}
    for i, b in enumerate(bundles):
        for r in _START.findall(b.text):
            starts.setdefault(int(r), i)
    branches = [
        (i, int(m.group(1))) for i, b in enumerate(bundles) for m in _BRANCH.finditer(b.text)
    ]
    delay = _delay_slots(bundles, [i for i, _ in branches])
    loops, regions = [], []
    branch_of: dict[int, int] = {}  # id(region) -> its branch's bundle
    for i, region in branches:
        t = starts.get(region)
        if t is None:
            continue
        if t <= i:
            loops.append(Loop(t, min(i + delay, len(bundles) - 1)))
        elif t > i + delay + 1:
            regions.append(Region(i + delay + 1, t))
            branch_of[id(regions[-1])] = i
    loops.sort(key=lambda lp: (lp.start, -lp.end))
    roots: list[Loop] = []
    stack: list[Loop] = []
    for lp in loops:
        while stack and not (stack[-1].start <= lp.start and lp.end <= stack[-1].end):
            stack.pop()
        (stack[-1].children if stack else roots).append(lp)
        stack.append(lp)

    def mark(lp: Loop) -> bool:
        own = any(_MXU.search(bundles[j].text) for j in range(lp.start, lp.end + 1))
        lp.mxu = own
        for c in lp.children:
            mark(c)
        return own

    for lp in roots:
        mark(lp)
    top: list[Region] = []
    # outermost first: a region's enclosing region of the same loop is placed before it
    for rg in sorted(regions, key=lambda r: (r.start, -r.end)):
        rg.dma_start = any(_DMA_START.search(bundles[j].text) for j in range(rg.start, rg.end))
        rg.dma_wait = any(_DMA_WAIT.search(bundles[j].text) for j in range(rg.start, rg.end))
        # A region belongs to the innermost loop holding its branch too: a loop's guard
        # whose delay slots hold the loop's first bundle (TPU7x: 3 slots) skips the rest
        # of the loop from outside it, so it is the guard, not a region of the loop.
        branch = branch_of[id(rg)]  # before rg.start: the region follows its delay slots
        owner = _innermost(roots, branch, rg.end - 1)
        rg.loops = [  # the loops whose back edge (``c.end - delay``) lies in the region
            c
            for c in (owner.children if owner else roots)
            if branch <= c.start and c.end - delay < rg.end
        ]
        siblings = owner.regions if owner else top
        # a region inside another region of the same loop is nested in it
        outer = next((o for o in siblings if o.start <= rg.start and rg.end <= o.end), None)
        while outer is not None:
            siblings = outer.regions
            outer = next((o for o in siblings if o.start <= rg.start and rg.end <= o.end), None)
        siblings.append(rg)
    return Dump(name, bundles, roots, top, delay)


def _all_loops(loops: Sequence[Loop]) -> list[Loop]:
    out = []
    for lp in loops:
        out.append(lp)
        out.extend(_all_loops(lp.children))
    return out


def _innermost(loops: Sequence[Loop], a: int, b: int) -> Loop | None:
    """Innermost loop holding bundles ``[a, b]`` in its body (a region that covers a whole
    loop, its guard, belongs to the loop's parent)."""
    for lp in loops:
        if lp.start <= a and b <= lp.end and not (a <= lp.start and lp.end <= b):
            return _innermost(lp.children, a, b) or lp
    return None


def iteration_cycles(
    loop: Loop,
    nested: Callable[[Loop], float | None],
    weight: Callable[[Loop, Region], float] = lambda _lp, _rg: 1.0,
) -> float:
    """Bundles one iteration of ``loop`` issues.

    Args:
      loop: the loop.
      nested: the cycles a nested loop takes per iteration of ``loop`` (its trips times its
        iteration cost), or None when it runs zero trips.
      weight: fraction of iterations that execute a region of this loop (a region nested in
        another one included: its fraction is capped by the enclosing region's); a region
        holding nested loops that all run zero trips is skipped whatever the weight says.
    """
    totals = {id(c): nested(c) for c in loop.children}
    cost = float(loop.span)
    for c in loop.children:
        cost += (totals[id(c)] or 0.0) - c.span

    def skipped(rg: Region, outer: float) -> float:
        """Bundles of ``rg`` not issued per iteration, when its enclosing region runs on a
        fraction ``outer`` of the iterations (a nested region's weight is capped by it)."""
        w = (
            0.0
            if rg.loops and all(totals.get(id(c)) is None for c in rg.loops)
            else min(weight(loop, rg), outer)
        )
        inner = sum((totals.get(id(c)) or 0.0) - c.span for c in rg.loops)
        return (outer - w) * (rg.span + inner) + sum(skipped(r, w) for r in rg.regions)

    return cost - sum(skipped(rg, 1.0) for rg in loop.regions)
