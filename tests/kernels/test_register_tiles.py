"""The built library's register tiles keep their accumulators in registers (wideserve/kernels/
disasm.py; docs/cpu_kernels.md, "Linear layers"). A tile GCC did not inline stored every
accumulator after every product and ran the fused experts' down GEMM at half the dots' rate
with right results (session 33): only its machine code shows it, so the check reads that."""
from __future__ import annotations

import pytest

from wideserve.kernels import disasm, loader
from wideserve.kernels.loader import cpu_ops_available

# objdump -d lines of one function: a K loop of 8 `vdpbf16ps` that stores each accumulator
# after its product (as an out-of-line tile did), then the same loop keeping them in
# registers, then a loop that calls a function (a tail chunk's decoder: its stores are meant).
_SPILLING = "\n".join(
    [f"{0x1000 + 16 * i:x}:\tvdpbf16ps (%rcx){{1to16}},%zmm1,%zmm{i + 8}\n"
     f"{0x1000 + 16 * i + 8:x}:\tvmovaps %zmm{i + 8},{64 * i:#x}(%r9)" for i in range(8)])
_CLEAN = "\n".join(f"{0x2000 + 8 * i:x}:\tvdpbf16ps (%rcx){{1to16}},%zmm1,%zmm{i + 8}"
                   for i in range(8))
_CALLS = "\n".join(
    [f"{0x3000 + 16 * i:x}:\tvdpbf16ps %zmm5,%zmm0,%zmm{i + 8}\n"
     f"{0x3000 + 16 * i + 8:x}:\tvmovaps %zmm{i + 8},{64 * i:#x}(%rbp)" for i in range(8)])
# One register for eight accumulators kept in stack slots (load, product, store back: the
# quantised experts' loop with a call in it, session 33), and a loop writing outputs: each
# product into a fresh value (a rotation's a * cos - b * sin), stored once.
_SLOTS = "\n".join(
    [f"{0x5000 + 24 * i:x}:\tvmovaps {-64 * (i + 1):#x}(%rbp),%zmm1\n"
     f"{0x5000 + 24 * i + 8:x}:\tvdpbf16ps %zmm7,%zmm0,%zmm1\n"
     f"{0x5000 + 24 * i + 16:x}:\tvmovaps %zmm1,{-64 * (i + 1):#x}(%rbp)" for i in range(8)])
_OUTPUTS = "\n".join(
    [f"{0x6000 + 24 * i:x}:\tvmulps {64 * i:#x}(%r13),%zmm0,%zmm{i + 8}\n"
     f"{0x6000 + 24 * i + 8:x}:\tvfmadd231ps {64 * i:#x}(%r14),%zmm5,%zmm{i + 8}\n"
     f"{0x6000 + 24 * i + 16:x}:\tvmovups %zmm{i + 8},{64 * i:#x}(%rbx)" for i in range(8)])
LISTING = f"""
0000000000001000 <void tile<8, 1>(float*)>:
{_SPILLING}
    1100:\tcmp    %rax,%rsi
    1103:\tjg     1000 <void tile<8, 1>(float*)+0x0>
    1105:\tret
0000000000002000 <void clean<8, 1>(float*)>:
{_CLEAN}
    2100:\tcmp    %rax,%rsi
    2103:\tjg     2000 <void clean<8, 1>(float*)+0x0>
    2200:\tvmovaps %zmm8,(%r9)
    2205:\tret
0000000000003000 <void tail<8>(float*)>:
{_CALLS}
    3100:\tcall   4000 <decode(int)>
    3105:\tcmp    %rax,%rsi
    3108:\tjg     3000 <void tail<8>(float*)+0x0>
    3110:\tret
0000000000005000 <void slots<2, 4>(float*)>:
{_SLOTS}
    5100:\tcmp    %rax,%rsi
    5103:\tjg     5000 <void slots<2, 4>(float*)+0x0>
    5105:\tret
0000000000006000 <void outputs<4>(float*)>:
{_OUTPUTS}
    6100:\tcmp    %rax,%rsi
    6103:\tjg     6000 <void outputs<4>(float*)+0x0>
    6105:\tret
"""


def _lines(text: str) -> str:
    # objdump indents instruction lines; the fragments above are written flush
    return "\n".join(l if l.startswith("0000") or not l.strip() else "    " + l.strip()
                     for l in text.splitlines())


def test_the_analysis_tells_a_spilling_tile_from_a_clean_one_and_a_call() -> None:
    loops = disasm.spilling_loops(_lines(LISTING))
    by_function = {l.function: l for l in loops}
    assert set(by_function) == {"void tile<8, 1>(float*)", "void tail<8>(float*)",
                                "void slots<2, 4>(float*)"}     # not outputs<4>
    for name in ("void tile<8, 1>(float*)", "void slots<2, 4>(float*)"):
        tile = by_function[name]
        assert (tile.products, tile.stores, tile.calls, tile.register_tile) == (8, 8, False, True)
    tail = by_function["void tail<8>(float*)"]
    assert tail.calls and not tail.register_tile


@pytest.mark.skipif(not cpu_ops_available(), reason="the C++ CPU ops are not built")
@pytest.mark.skipif(not disasm.objdump_available(), reason="objdump (binutils) not found")
def test_the_loaded_library_keeps_every_register_tile_in_registers() -> None:
    loops = disasm.spilling_loops(disasm.disassemble(loader.build()))
    tiles = [f"{l.function[:120]}: {l.products} products, {l.stores} stores"
             for l in loops if l.register_tile]
    assert not tiles, "register tiles storing their accumulators every pass:\n" + "\n".join(tiles)
