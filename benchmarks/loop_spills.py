"""Inner loops of the built CPU kernels that store their accumulators on every pass (BENCHMARKS.md,
"Zen 4: accumulators kept in registers").

A register tile keeps its fp32 accumulators in zmm registers through the K loop and stores them
once at the end. GCC keeps them in memory instead, storing each after every product, when the
tile's accumulator array is the caller's (a function taking it by reference, not inlined: the
weight loads may alias it) or when the loop holds a call, even on a branch that never runs.
Nothing in the results shows it: only the speed (session 33 found the fused experts' down
GEMM at about half the dot products' rate this way). This lists, from the disassembly
(`objdump`), every innermost loop with at least four dot products or FMAs on zmm registers
and at least half as many zmm stores to memory. Some are meant (an output row written per
pass, a scatter-add, a loop around a call, marked "call": the call clobbers every vector
register, so a loop that makes one on every pass keeps its sums in memory); a register
tile's K loop should never be among them.

  python benchmarks/loop_spills.py [LIBRARY.so]   # default: the library this machine loads
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

JUMP = re.compile(r"j\w+\s+([0-9a-f]+) <")
BRANCH = re.compile(r"j(?!mp)\w+\s+([0-9a-f]+) <")   # conditional: a loop's back edge
PRODUCT = re.compile(r"(?:vdpbf16ps|vfmadd\w+|vpdpbusd)\s.*,(%zmm\d+)$")   # its accumulator
STORE = re.compile(r"vmov\w+\s+(%zmm\d+),.*\(")
LINE = re.compile(r"^\s+([0-9a-f]+):\s+(.*)$")
FUNC = re.compile(r"^[0-9a-f]+ <(.*)>:$")


def functions(text: str):
    """(name, [(address, instruction)]) for each function of objdump's output."""
    name, insns = None, []
    for line in text.splitlines():
        m = FUNC.match(line)
        if m:
            if name:
                yield name, insns
            name, insns = m.group(1), []
            continue
        m = LINE.match(line)
        if m and name:
            insns.append((int(m.group(1), 16), m.group(2)))
    if name:
        yield name, insns


def spilling_loops(insns: list[tuple[int, str]]) -> list[tuple[int, int, bool]]:
    """(products, stores, calls) of each innermost loop (a conditional backward branch, no
    `ret` inside) that stores the registers its products accumulate into; calls: the loop
    holds a call."""
    out = []
    for addr, ins in insns:
        m = BRANCH.match(ins)
        if not m or int(m.group(1), 16) >= addr:
            continue
        top = int(m.group(1), 16)
        body = [s for a, s in insns if top <= a <= addr]
        inner = any(JUMP.match(s) and top <= int(JUMP.match(s).group(1), 16) < a
                    for a, s in insns if top <= a < addr)
        if inner or any(s.startswith("ret") for s in body):
            continue
        accs = [m.group(1) for m in map(PRODUCT.search, body) if m]
        stores = sum(1 for m in map(STORE.match, body) if m and m.group(1) in accs)
        if len(accs) >= 4 and stores * 2 >= len(accs):
            out.append((len(accs), stores, any(b.startswith("call") for b in body)))
    return out


def main() -> None:
    if shutil.which("objdump") is None:
        raise SystemExit("objdump not found (binutils)")
    if len(sys.argv) > 1:
        lib = sys.argv[1]
    else:
        from wideserve.kernels import loader
        lib = str(loader.build())
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", lib], check=True,
                          capture_output=True, text=True).stdout
    print(f"# {lib}")
    for name, insns in functions(text):
        for products, stores, calls in sorted(set(spilling_loops(insns))):
            print(f"{products:3d} products {stores:3d} stores {'call' if calls else '    '}  "
                  f"{name[:150]}")


if __name__ == "__main__":
    main()
