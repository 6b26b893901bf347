"""compressed-tensors `pack-quantized` INT4 weights (W4A16), as Kimi K2.5/K2.6 ship their routed
experts: per linear `weight_packed` int32 [out, in / 8] (eight 4-bit values per word, lowest bits
first, each stored as value + 8), `weight_scale` [out, in / group] (one scale per `group` input
columns, symmetric: no zero point) and `weight_shape` [2]. The weights stay packed in memory;
`dequantize_int4` unpacks a whole matrix to the scale's dtype before its matmul (the CPU path
and the reference), while on CUDA the grouped-GEMM kernels (`layers/fused_moe.py`) unpack
their tiles."""

from __future__ import annotations

import json
import sys

import torch

ALLOWED = ("compressed-tensors format pack-quantized: one config group of 4-bit symmetric int "
           "weights with strategy group, no activation quantization")


def int4_group_size(quantization_config: str) -> int:
    """The group size of a checkpoint's INT4 scheme (its `quantization_config` as JSON), read
    with the compressed-tensors package; a ValueError names what is not supported."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError as e:
        raise ValueError("INT4 compressed-tensors checkpoints need the compressed-tensors "
                         "package: pip install compressed-tensors") from e
    q = QuantizationConfig.model_validate(json.loads(quantization_config))
    schemes = list(q.config_groups.values())
    w = schemes[0].weights if len(schemes) == 1 else None
    problems = []
    if q.format != "pack-quantized":
        problems.append(f"format {q.format!r}")
    if w is None:
        problems.append(f"{len(schemes)} config groups")
    elif (w.num_bits, w.type, w.symmetric, w.strategy) != (4, "int", True, "group"):
        problems.append(f"weights of {w.num_bits} bits, type {w.type}, symmetric {w.symmetric}, "
                        f"strategy {w.strategy}")
    if any(s.input_activations is not None or s.output_activations is not None
           for s in schemes):
        problems.append("quantized activations")
    if problems:
        raise ValueError(f"compressed-tensors scheme not supported ({', '.join(problems)}); "
                         f"allowed: {ALLOWED}")
    assert w is not None and w.group_size
    return int(w.group_size)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """packed int32 [rows, cols / 8], scale [rows, cols / group] -> weight [rows, cols] in the
    scale's dtype."""
    assert sys.byteorder == "little", "the nibble order assumes a little-endian host"
    rows = packed.shape[0]
    nibbles = packed.contiguous().view(torch.uint8)  # [rows, cols / 2], lowest bits first
    values = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).view(rows, -1).to(scale.dtype)
    return ((values - 8).view(rows, scale.shape[1], group) * scale[..., None]).view(rows, -1)
