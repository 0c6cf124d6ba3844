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
branch and no `ret` inside) that stores at least half of the zmm registers its dot products
or FMAs accumulate into. Used by `benchmarks/loop_spills.py` and tests/kernels.
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
_STORE = re.compile(r"vmov\w+\s+(%zmm\d+),.*\(")
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
        accs = {m.group(1) for m in map(_PRODUCT.search, body) if m}
        products = sum(1 for s in body if _PRODUCT.search(s))
        stores = sum(1 for m in map(_STORE.match, body) if m and m.group(1) in accs)
        if products >= 4 and stores * 2 >= products:
            yield Loop(name, products, stores, any(s.startswith("call") for s in body))


def spilling_loops(text: str) -> list[Loop]:
    """Every innermost loop of objdump's `text` that stores its accumulators each pass."""
    return sorted({loop for name, insns in _functions(text) for loop in _loops_of(name, insns)},
                  key=lambda l: (l.function, l.products, l.stores))
