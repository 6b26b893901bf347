"""INT4 words to scaled bf16 weights in packed instructions, for the tensor-core INT4 tiles.

A word holds eight 4-bit values along the input dim (lowest bits first, each stored as value +
8); `scaled_planes` returns plane j (value j of every word) times its group's scale. Two words'
bytes are gathered by one `prmt`, a nibble pair becomes two bf16 numbers 128 + nibble by one
`lop3` (the nibbles OR'd into the mantissas of 0x4300 = 128.0), and two bf16x2 FMAs subtract
136 (exact) and multiply by the scale: one rounding, as the eager path's bf16 `(v - 8) * scale`
rounds. About two instructions a value where the scalar unpack (shift, mask, int-to-float,
multiply, float-to-bf16) spends five, two of them on the slow conversion pipe. Needs sm_80 and
the compiler (inline PTX): the interpreter takes the scalar path."""

from __future__ import annotations

import triton
import triton.language as tl

_PLANES_ASM = tl.constexpr("""{
.reg .b32 b<4>, h<4>, one, bias, zero;
mov.b32 one, 0x3F803F80;
mov.b32 bias, 0xC308C308;
mov.b32 zero, 0x80008000;
prmt.b32 b0, $8, $9, 0x0400;
prmt.b32 b1, $8, $9, 0x0501;
prmt.b32 b2, $8, $9, 0x0602;
prmt.b32 b3, $8, $9, 0x0703;
shr.u32 h0, b0, 4;
shr.u32 h1, b1, 4;
shr.u32 h2, b2, 4;
shr.u32 h3, b3, 4;
lop3.b32 $0, b0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $1, h0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $2, b1, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $3, h1, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $4, b2, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $5, h2, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $6, b3, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $7, h3, 0x000F000F, 0x43004300, 0xEA;
""" + "".join(f"fma.rn.bf16x2 ${j}, ${j}, one, bias;\nfma.rn.bf16x2 ${j}, ${j}, $10, zero;\n"
              for j in range(8)) + "}")


@triton.jit
def scaled_planes(words, scale):
    """words int32 [...], scale bf16 [...] (each word's group scale) -> eight bf16 tensors of
    words' shape: plane j = (value j of the word - 8) * scale, rounded once to bf16. Each asm
    instance takes two words (element pairs of the thread's registers) and one bf16x2 scale
    pair, and writes each plane's two values as one bf16x2 register."""
    return tl.inline_asm_elementwise(
        _PLANES_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, scale],
        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
