"""A rank's routed experts stacked as the grouped GEMMs of `layers/fused_moe.py` read them."""

from __future__ import annotations

from typing import NamedTuple

import torch


class StackedExperts(NamedTuple):
    """One rank's routed experts as the grouped GEMMs read them: gate_up [E, 2I, H] (gate rows,
    then up) and down [E, H, I]; with `group`, INT4 packed eight to an int32 along the input
    dim ([E, 2I, H / 8], [E, H, I / 8]) with scales [E, 2I, H / group], [E, H, I / group];
    with `fp8_block` (bo, bi), float8 with one float32 scale per bo x bi block."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    group: int = 0
    fp8_block: tuple[int, int] | None = None

    @property
    def inter(self) -> int:
        return self.gate_up.shape[1] // 2
