"""Mixture-of-experts block: top-k router (softmax or sigmoid scoring, group-limited selection,
DeepSeek's selection-only correction bias, renormalization and scaling), routed SiLU-GLU experts,
optional shared experts.

Parallel layout (SGLang's `--tp T --ep E` convention, E divides T): the routed experts are split
into E groups of num_experts / E; the T / E ranks of one group hold the same experts, each sliced
along the expert's intermediate dim. Tokens are replicated on every TP rank (the residual stream
is), so there is no dispatch: every rank runs ITS experts (its slices) on the tokens routed to
them and the block ends with ONE all-reduce over the TP group that sums the routed partials of
all ranks plus the TP-sharded shared experts' partials."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashtree.distributed import get_ep_rank, get_ep_size, get_moe_tp, tp_all_reduce
from flashtree.layers import dense_fp32, fused_kernels_apply
from flashtree.layers.activation import silu_mul
from flashtree.layers.config import MoEConfig
from flashtree.layers.int4 import dequantize_int4
from flashtree.layers.linear import ColumnParallelLinear, RowParallelLinear
from flashtree.layers.stacked_experts import StackedExperts


def _check_shape(name: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"tensor {name} has shape {tuple(loaded.shape)}, expected {expected}")


class Router(nn.Module):
    """x [n, hidden] -> (weights [n, top_k] float32, expert ids [n, top_k] int64)."""

    def __init__(self, cfg: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, hidden), requires_grad=False)
        # noaux_tc: added to the scores to SELECT experts, never to weight them.
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
            if cfg.topk_method == "noaux_tc" else None
        )

    def _apply(self, fn, recurse: bool = True):
        # DeepSeek keeps the router in float32 whatever the model dtype (as transformers does).
        super()._apply(fn, recurse)
        if self.cfg.router_fp32:
            self.weight.data = self.weight.data.float()
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.data = self.e_score_correction_bias.data.float()
        return self

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        target = (self.e_score_correction_bias if name.endswith("e_score_correction_bias")
                  else self.weight)
        assert target is not None, f"{name}: this router ({self.cfg.topk_method}) has no bias"
        _check_shape(name, loaded, tuple(target.shape))
        target.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.router_fp32:
            logits = dense_fp32(x, self.weight)  # [n, E]
        else:
            logits = F.linear(x, self.weight).float()
        if fused_kernels_apply(x):  # one launch (`layers/moe_router.py`) for `select`'s ops
            from flashtree.layers.moe_router import route

            return route(logits, self.e_score_correction_bias, self.cfg)
        return self.select(logits)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager selection: float32 logits [n, E] -> (weights, ids) [n, top_k]."""
        cfg = self.cfg
        if cfg.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else (
            scores + self.e_score_correction_bias)
        if cfg.n_group > 1:
            grouped = choice.view(logits.shape[0], cfg.n_group, -1)  # [n, groups, E / groups]
            if cfg.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [n, groups]
            else:
                group_scores = grouped.amax(dim=-1)
            best = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        ids = choice.topk(cfg.top_k, dim=-1, sorted=False)[1]  # [n, top_k]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


class _ExpertLinear(nn.Module):
    """This rank's slice of an expert matrix: `stacked` [inter, hidden] matrices (gate, up)
    sliced along rows (split_dim 0), or one [hidden, inter] matrix (down) along columns. As the
    checkpoint holds it: dense `weight`; with `int4_group`, packed INT4 (`layers/int4.py`:
    `weight_packed` and `weight_scale` sliced the same way, `weight_shape` checked); with
    `fp8_block` (bo, bi), a float8 `weight` and one float32 `weight_scale_inv` per block."""

    def __init__(self, hidden: int, inter: int, stacked: int, split_dim: int,
                 int4_group: int = 0, fp8_block: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.rank, parts = get_moe_tp()
        if inter % parts:
            raise ValueError(f"moe_intermediate_size {inter} does not split into {parts} parts "
                             f"(tensor parallel size / expert parallel size)")
        self.shard, self.split_dim, self.group = inter // parts, split_dim, int4_group
        self.fp8_block = fp8_block
        self.full = (inter, hidden) if split_dim == 0 else (hidden, inter)
        rows, cols = (stacked * self.shard, hidden) if split_dim == 0 else (hidden, self.shard)
        if int4_group:
            if cols % int4_group or int4_group % 8:
                raise ValueError(f"INT4 experts: {cols} input columns per rank do not split "
                                 f"into groups of {int4_group} (a multiple of 8)")
            self.weight_packed = nn.Parameter(torch.empty(rows, cols // 8, dtype=torch.int32),
                                              requires_grad=False)
            self.weight_scale = nn.Parameter(torch.empty(rows, cols // int4_group),
                                             requires_grad=False)
            self.weight_shape = nn.Parameter(torch.tensor(self.full), requires_grad=False)
            return
        dtype = torch.float8_e4m3fn if fp8_block else None
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)
        if fp8_block:
            bo, bi = fp8_block
            if self.shard % (bo if split_dim == 0 else bi):
                raise ValueError(f"FP8 experts: {self.shard} intermediate rows or columns per "
                                 f"rank do not split into whole {bo}x{bi} blocks")
            self.weight_scale_inv = nn.Parameter(torch.empty(-(-rows // bo), -(-cols // bi)),
                                                 requires_grad=False)

    def _apply(self, fn, recurse: bool = True):
        # FP8 experts keep the checkpoint's float8 weights and float32 scales whatever the
        # model dtype (float8 -> bf16/fp32 -> float8 is exact).
        super()._apply(fn, recurse)
        if self.fp8_block:
            self.weight.data = self.weight.data.to(torch.float8_e4m3fn)
            self.weight_scale_inv.data = self.weight_scale_inv.data.float()
        return self

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        kind = name.rpartition(".")[2]
        if kind == "weight_shape":
            if tuple(loaded.tolist()) != self.full:
                raise ValueError(f"tensor {name} says {tuple(loaded.tolist())}, expected "
                                 f"{self.full}")
            return
        if kind == "weight_scale_inv":  # one scale per block: the weight's slice in blocks
            assert self.fp8_block is not None
            block = self.fp8_block[self.split_dim]
            full = tuple(-(-d // b) for d, b in zip(self.full, self.fp8_block))
            per_rows = self.shard // block
        else:  # packed and scale tensors: the weight with its input columns divided by `per`
            per = {"weight": 1, "weight_packed": 8, "weight_scale": self.group}[kind]
            full = (self.full[0], self.full[1] // per)
            block = 1 if self.split_dim == 0 else per
            per_rows = self.shard
        _check_shape(name, loaded, full)
        size = self.shard // block
        part = loaded.narrow(self.split_dim, self.rank * size, size)
        getattr(self, kind).data.narrow(0, shard * per_rows, part.shape[0]).copy_(part)

    def matrix(self) -> torch.Tensor:
        """The weight as a dense matrix (unpacked where it is INT4, scaled where it is FP8)."""
        if self.group:
            return dequantize_int4(self.weight_packed, self.weight_scale, self.group)
        if self.fp8_block:
            (bo, bi), (rows, cols) = self.fp8_block, self.weight.shape
            scale = self.weight_scale_inv.repeat_interleave(bo, 0)[:rows]
            return self.weight.float() * scale.repeat_interleave(bi, 1)[:, :cols]
        return self.weight


class ExpertMLP(nn.Module):
    """One routed expert's slice: rows [r * I/p, (r+1) * I/p) of gate and up, the same columns
    of down, for (r, p) = this rank's place in its expert group. Returns a partial sum."""

    def __init__(self, hidden: int, inter: int, int4_group: int = 0,
                 fp8_block: tuple[int, int] | None = None) -> None:
        super().__init__()
        quant = dict(int4_group=int4_group, fp8_block=fp8_block)
        self.gate_up_proj = _ExpertLinear(hidden, inter, 2, split_dim=0, **quant)
        self.down_proj = _ExpertLinear(hidden, inter, 1, split_dim=1, **quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.matrix().to(x.dtype)
        return F.linear(silu_mul(F.linear(x, gate_up)), self.down_proj.matrix().to(x.dtype))


class SharedMLP(nn.Module):
    """Shared experts fused into one SiLU-GLU MLP, TP-sharded; returns a partial sum."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter])
        self.down_proj = RowParallelLinear(inter, hidden, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """x [n, hidden] -> [n, hidden] (all-reduced over the TP group)."""

    def __init__(self, cfg: MoEConfig, hidden: int) -> None:
        super().__init__()
        ep = get_ep_size()
        if cfg.num_experts % ep:
            raise ValueError(f"{cfg.num_experts} routed experts do not split over expert "
                             f"parallel size {ep}")
        per_rank = cfg.num_experts // ep
        self.first_expert = get_ep_rank() * per_rank
        self.num_local = per_rank
        self.gate = Router(cfg, hidden)
        # Keyed by the GLOBAL expert id, so parameter names are the checkpoint's.
        self.experts = nn.ModuleDict({
            str(e): ExpertMLP(hidden, cfg.intermediate_size, cfg.int4_group, cfg.fp8_block)
            for e in range(self.first_expert, self.first_expert + per_rank)
        })
        self.shared_experts = (
            SharedMLP(hidden, cfg.intermediate_size * cfg.num_shared_experts)
            if cfg.num_shared_experts else None
        )
        self.stacked: StackedExperts | None = None  # set once the weights are loaded

    def owns(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.num_local

    def weights_loaded(self) -> None:
        """Stack the experts' weights (and INT4 or FP8 scales) into [E, ...] tensors for
        the grouped GEMMs (`layers/fused_moe.py`); each expert's parameters become views of
        them, so the memory is not doubled."""
        experts = list(self.experts.values())
        group, fp8_block = experts[0].gate_up_proj.group, experts[0].gate_up_proj.fp8_block
        kinds = (("weight_packed", "weight_scale") if group else
                 ("weight", "weight_scale_inv") if fp8_block else ("weight", None))

        def stack(part: str, kind: str | None) -> torch.Tensor | None:
            if kind is None:
                return None
            params = [getattr(getattr(e, part), kind) for e in experts]
            whole = torch.stack([p.data for p in params])
            for i, p in enumerate(params):
                p.data = whole[i]
            return whole
        gate_up, gate_up_scale = (stack("gate_up_proj", k) for k in kinds)
        down, down_scale = (stack("down_proj", k) for k in kinds)
        assert gate_up is not None and down is not None
        self.stacked = StackedExperts(gate_up, down, gate_up_scale, down_scale, group, fp8_block)

    def _apply(self, fn, recurse: bool = True):
        # A `.to()` after loading copies each expert's parameters apart: stack them again.
        super()._apply(fn, recurse)
        if self.stacked is not None:
            self.weights_loaded()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [n, top_k] each
        if self.stacked is not None and fused_kernels_apply(x):
            from flashtree.layers.fused_moe import fused_experts

            shared = None if self.shared_experts is None else self.shared_experts(x)
            return tp_all_reduce(fused_experts(x, self.stacked, weights, ids, self.first_expert,
                                               routed_experts=self.gate.cfg.num_experts,
                                               shared=shared))
        out = torch.zeros_like(x)
        local = ids - self.first_expert
        counts = torch.bincount(local[(local >= 0) & (local < self.num_local)],
                                minlength=self.num_local).tolist()
        # Ascending expert order and index_add, as transformers sums, so fp32 results match.
        for e, count in enumerate(counts):
            if not count:
                continue
            tok, slot = torch.where(ids == self.first_expert + e)
            y = self.experts[str(self.first_expert + e)](x[tok])
            y = y * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tp_all_reduce(out)
