"""Inner loops of the built CPU kernels that store their accumulators on every pass (BENCHMARKS.md,
"Zen 4: accumulators kept in registers"; the analysis: wideserve/kernels/disasm.py).

A register tile keeps its fp32 accumulators in zmm registers through the K loop and stores them
once at the end; GCC stores each after every product instead when the tile's accumulator array
is a non-inlined caller's, or when the loop holds a call. Nothing in the results shows it, only
the speed. Lists every innermost loop with at least four accumulating dot products or FMAs
on zmm registers that stores at least half of what they accumulate (disasm.py says which
products accumulate). Some are meant (an output
row written per pass, a scatter-add, a loop around a call, marked "call"); a register tile's
K loop ("TILE") should never be among them (tests/kernels/test_register_tiles.py).

  python benchmarks/loop_spills.py [LIBRARY.so]   # default: the library this machine loads
"""
from __future__ import annotations

import sys

from wideserve.kernels import disasm


def main() -> None:
    if not disasm.objdump_available():
        raise SystemExit("objdump not found (binutils)")
    if len(sys.argv) > 1:
        lib = sys.argv[1]
    else:
        from wideserve.kernels import loader
        lib = str(loader.build())
    print(f"# {lib}")
    for loop in disasm.spilling_loops(disasm.disassemble(lib)):
        kind = "TILE" if loop.register_tile else ("call" if loop.calls else "    ")
        print(f"{loop.products:3d} products {loop.stores:3d} stores {kind}  {loop.function[:150]}")


if __name__ == "__main__":
    main()
