"""The built CPU library's inner loops that store their accumulators on every pass
(docs/cpu_kernels.md, "Linear layers": the accumulators stay in registers only where the
tile is inlined).

A register tile keeps its fp32 accumulators in vector registers through its K loop and stores
them once at the end. GCC keeps them in memory instead, storing each after every product, when
the tile's accumulator array is the caller's (a function that takes it by reference and is
not inlined: the weight loads may alias it) or when the loop holds a call, even on a branch
that never runs. The results stay right; only the speed shows it (session 33: the fused
experts' down GEMM at about half the dot products' rate). This reads `objdump -d` of the
library and finds every innermost loop (a conditional backward branch with no other backward
branch and no `ret` inside) that stores at least half of what its dot products or FMAs
accumulate: registers only products write (the tile's own), and values loaded from a stack
slot and stored back to it (a spilled tile, one register for many). A product into a value
computed afresh each pass and stored once is an output (a norm's, a rotation's), not counted.
Used by `benchmarks/loop_spills.py` and tests/kernels.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

_JUMP = re.compile(r"j\w+\s+([0-9a-f]+) <")
_BRANCH = re.compile(r"j(?!mp)\w+\s+([0-9a-f]+) <")        # conditional: a loop's back edge
_PRODUCT = re.compile(r"(?:vdpbf16ps|vfmadd\w+|vpdpbusd)\s.*,(%zmm\d+)$")   # its accumulator
_STORE = re.compile(r"vmov\w+\s+(%zmm\d+),(.*\(.*)$")          # register, address
_LOAD = re.compile(r"vmov\w+\s+(.*\(.*\)),(%zmm\d+)$")           # address, register
_WRITE = re.compile(r",(%zmm\d+)(?:\{[^}]*\})*$")   # any instruction's zmm destination
_LINE = re.compile(r"^\s+([0-9a-f]+):\s+(.*)$")
_FUNC = re.compile(r"^[0-9a-f]+ <(.*)>:$")

# A register tile has at least this many accumulating products in its loop; smaller loops that
# store what they accumulate are mostly meant (a scatter-add writing the output each pass).
TILE_PRODUCTS = 8


@dataclass(frozen=True)
class Loop:
    function: str
    products: int      # accumulating dot products / FMAs on zmm registers
    stores: int        # zmm stores of those accumulators
    calls: bool        # the loop holds a call (which clobbers every vector register)

    @property
    def register_tile(self) -> bool:
        """A register tile's K loop, which should never store its accumulators: enough
        products, and no call that would force it to."""
        return self.products >= TILE_PRODUCTS and not self.calls


def objdump_available() -> bool:
    return shutil.which("objdump") is not None


def disassemble(library: Path | str) -> str:
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", str(library)],
                          check=True, capture_output=True, text=True).stdout


def _functions(text: str) -> Iterator[tuple[str, list[tuple[int, str]]]]:
    """(name, [(address, instruction)]) for each function of objdump's output."""
    name, insns = None, []
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            if name:
                yield name, insns
            name, insns = m.group(1), []
            continue
        m = _LINE.match(line)
        if m and name:
            insns.append((int(m.group(1), 16), m.group(2)))
    if name:
        yield name, insns


def _accumulating(body: list[str]) -> tuple[int, int]:
    """(products, stored) over a loop body's accumulating products: those whose register
    carries its value from pass to pass (only products write it), and those that add into a
    value loaded from a memory slot they store back to (an accumulator spilled to the stack,
    one register serving many); `stored`: how many of them the loop stores. A product into a
    value computed or loaded otherwise starts afresh each pass (an output written once: a
    norm's, a rotation's) and is not counted."""
    n = len(body)
    dest = [m.group(1) if (m := _WRITE.search(s)) and not _STORE.match(s) else None
            for s in body]
    product = [bool(_PRODUCT.search(s)) for s in body]
    products = stored = 0
    for i in range(n):
        if not product[i]:
            continue
        r = dest[i]
        if not any(dest[j] == r and not product[j] for j in range(n)):   # a register one
            products += 1
            stored += any((m := _STORE.match(s)) and m.group(1) == r for s in body)
            continue
        j = (i - 1) % n                       # the value's origin, back past products
        while dest[j] != r or product[j]:
            j = (j - 1) % n
        load = _LOAD.match(body[j])
        if load is None:
            continue                          # computed: fresh
        k = (i + 1) % n                       # where the value goes before r is rewritten
        while k != j and not ((m := _STORE.match(body[k])) and m.group(1) == r) \
                and not (dest[k] == r and not product[k]):
            k = (k + 1) % n
        m = _STORE.match(body[k])
        if m is not None and m.group(1) == r and m.group(2) == load.group(1):
            products += 1                     # a spilled accumulator: its own slot
            stored += 1
    return products, stored


def _loops_of(name: str, insns: list[tuple[int, str]]) -> Iterator[Loop]:
    jumps = [(a, int(m.group(1), 16)) for a, s in insns if (m := _JUMP.match(s))]
    for addr, ins in insns:
        m = _BRANCH.match(ins)
        if not m or int(m.group(1), 16) >= addr:
            continue
        top = int(m.group(1), 16)
        if any(top <= a < addr and top <= t < a for a, t in jumps):
            continue                                    # not innermost
        body = [s for a, s in insns if top <= a <= addr]
        if any(s.startswith("ret") for s in body):
            continue                                    # a tail block, not a loop
        products, stores = _accumulating(body)
        if products >= 4 and stores * 2 >= products:
            yield Loop(name, products, stores, any(s.startswith("call") for s in body))


def spilling_loops(text: str) -> list[Loop]:
    """Every innermost loop of objdump's `text` that stores its accumulators each pass."""
    return sorted({loop for name, insns in _functions(text) for loop in _loops_of(name, insns)},
                  key=lambda l: (l.function, l.products, l.stores))
