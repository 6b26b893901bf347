"""Linear weights kept as 4-bit codes on the CPU: GGUF Q4_0 / Q4_1 blocks (32 weights, a scale
and, for Q4_1, a minimum) repacked at load into PyTorch's int4 layout, multiplied by
`aten._weight_int4pack_mm_for_cpu`, whose fast path reads bfloat16 activations, scales and zeros
(its float32 and float16 paths are 4-40x slower than a float32 matmul). The codes are the file's
exactly; the products differ from float32 by those bfloat16 roundings. A decode step
streams its weights from memory, so 4-bit codes (84 MB for the default model against 538 MB as
float32) run its matmuls 3.35x faster on 2 cores
(`benchmarks/results/archive/2026-12-05-cpu-kernels.md`)."""

from __future__ import annotations

import functools

import numpy as np
import torch

GROUP = 32  # weights per GGUF block


class Int4Weight:
    """A [out, in] weight as int4 codes c with per-group scale d and zero z: w = (c - 8) d + z."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        out_features, in_features = codes.shape
        assert scales.shape == zeros.shape == (out_features, in_features // GROUP), (
            f"codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, zeros "
            f"{tuple(zeros.shape)}")
        self.shape = (out_features, in_features)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 2)
        # [in / GROUP, out, 2]
        self.scales_and_zeros = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous()
        self.scales_and_zeros = self.scales_and_zeros.bfloat16()

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], prefix: str) -> Int4Weight:
        """The weight `state(prefix)` saved (the packed form, cached beside a GGUF's)."""
        weight = cls.__new__(cls)
        weight.packed = tensors[f"{prefix}.packed"]
        weight.scales_and_zeros = tensors[f"{prefix}.scales_and_zeros"]
        groups, out_features, _ = weight.scales_and_zeros.shape
        weight.shape = (out_features, groups * GROUP)
        return weight

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.packed": self.packed,
                f"{prefix}.scales_and_zeros": self.scales_and_zeros}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x W^T [..., out] in x's dtype."""
        rows = x.reshape(-1, self.shape[1]).bfloat16()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP,
                                                        self.scales_and_zeros)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.shape[0])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in float32 (an embedding lookup), unpacked from the kernel's layout:
        byte [r // 64, k, r % 32] holds row r's code k in its low nibble when r % 64 < 32, in
        its high nibble otherwise (checked by `check_layout` before packing rows)."""
        blocks = self.packed.view(-1, self.shape[1], _PACK_ROWS // 2)
        cols = ids % _PACK_ROWS
        packed = blocks[ids // _PACK_ROWS, :, cols % (_PACK_ROWS // 2)]  # [n, in]
        codes = torch.where((cols < _PACK_ROWS // 2)[:, None], packed & 0x0F, packed >> 4)
        scale, zero = self.scales_and_zeros[:, ids].float().unbind(-1)  # [in / GROUP, n]
        grouped = (codes.float() - 8).view(len(ids), -1, GROUP)
        return (grouped * scale.t()[..., None] + zero.t()[..., None]).view(len(ids), -1)


_PACK_ROWS = 64  # rows of W interleaved in one block of the CPU int4 layout


@functools.cache
def check_layout() -> None:
    """`Int4Weight.rows` reads PyTorch's private packed layout; a PyTorch that packs otherwise
    fails here, before an embedding is packed, instead of returning wrong embeddings."""
    codes = torch.arange(2 * _PACK_ROWS * GROUP).view(2 * _PACK_ROWS, GROUP) * 7 % 16
    ones = torch.ones(2 * _PACK_ROWS, 1)
    w = Int4Weight(codes, ones, 8 * ones)
    got = w.rows(torch.arange(2 * _PACK_ROWS))
    assert torch.equal(got, codes.float()), "PyTorch's CPU int4 packing changed its layout"


class Q8Weight:
    """A [out, in] weight of signed 8-bit codes c with a scale d per group of 32 (GGUF Q8_0,
    w = c d), multiplied as two 4-bit planes of c + 128 = 16 h + l through the int4 kernel:
    w = (h - 8) 16 d + (l - 8) d + 8 d. Two 4-bit reads cost less than one float32 or bfloat16
    read of the same weight (the LM head:
    `benchmarks/results/archive/2026-12-05-cpu-kernels.md`)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        unsigned = codes.int() + 128
        self.shape = tuple(codes.shape)
        self.high = Int4Weight(unsigned >> 4, 16 * scales, torch.zeros_like(scales))
        self.low = Int4Weight(unsigned & 0x0F, scales, 8 * scales)

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], prefix: str) -> Q8Weight:
        weight = cls.__new__(cls)
        weight.high = Int4Weight.from_state(tensors, f"{prefix}.high")
        weight.low = Int4Weight.from_state(tensors, f"{prefix}.low")
        weight.shape = weight.high.shape
        return weight

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        return {**self.high.state(f"{prefix}.high"), **self.low.state(f"{prefix}.low")}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.high.matmul(x) + self.low.matmul(x)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.high.rows(ids) + self.low.rows(ids)


def gguf_q8_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF Q8_0 tensor's raw blocks [rows, bytes] -> codes [rows, in] (int8) and scales
    [rows, in / GROUP] such that code * scale is the value."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 34)  # fp16 scale, then 32 signed bytes
    scale = _half(blocks, 0)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return codes, scale


def gguf_q4_blocks(raw: np.ndarray, q4_1: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF Q4_0 / Q4_1 tensor's raw blocks [rows, bytes] -> codes [rows, in] (0..15),
    scales and zeros [rows, in / GROUP] such that (code - 8) * scale + zero is the value."""
    block = 20 if q4_1 else 18  # fp16 scale (and fp16 minimum), then 16 bytes of nibbles
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, block)
    scale = _half(blocks, 0)
    nibbles = blocks[..., block - 16:]
    # Byte j holds weight j in its low nibble and weight j + 16 in its high one.
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    if q4_1:
        minimum = _half(blocks, 2)
        zero = minimum + 8 * scale  # w = scale * code + minimum
    else:
        zero = np.zeros_like(scale)  # w = scale * (code - 8)
    return codes.astype(np.int32), scale, zero



def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte `at` of every block, as float32."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)
