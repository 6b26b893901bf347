"""DeepSeek-V3 / Kimi K2 (DeepseekV3ForCausalLM): multi-head latent attention (MLA), dense MLP in
the first `first_k_dense_replace` layers, then sigmoid-routed experts plus shared experts.

MLA over a latent paged cache, with the up-projection ABSORBED (as production engines decode):
per token the cache holds `c = RMSNorm(kv_a(x)[:kv_lora_rank])` and the roped shared key
`k_pe`, one "head" of kv_lora_rank + qk_rope_head_dim values, no separate V. With
kv_b = [W_UK | W_UV] per head, q_nope . (W_UK c) = (W_UK^T q_nope) . c, so the query becomes
[W_UK^T q_nope | rope(q_pe)] and attends to [c | k_pe] directly; the output is
W_UV (softmax . c). Prefill, decode and tree verification all take this one path (the tree
mask goes through the backend's plan as for every model)."""

from __future__ import annotations

import torch
from torch import nn

from flashtree.attention.backend import AttentionBackend
from flashtree.distributed import get_tp_size
from flashtree.layers import fused_kernels_apply
from flashtree.layers.linear import ColumnParallelLinear, RowParallelLinear
from flashtree.layers.norm import RMSNorm
from flashtree.layers.rotary import apply_rotary, deinterleave, softmax_mscale
from flashtree.models.config import ModelConfig
from flashtree.models.llama import DecoderModel
from flashtree.models.qwen3_moe import MoEDecoderLayer, skip_moe_tensor

RopeTables = tuple[torch.Tensor, torch.Tensor]

# DeepSeek's q_a / kv_a layernorms use the RMSNorm default eps, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """TP: q_b / kv_b column-split by head, o_proj row-split, q_a / kv_a replicated; every rank
    caches the whole latent (it has one head)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None, "MLAttention needs ModelConfig.mla"
        tp = get_tp_size()
        if cfg.num_heads % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide {cfg.num_heads} MLA "
                             "attention heads")
        self.layer, self.m = layer, m
        self.num_heads = cfg.num_heads // tp  # this rank's heads
        self.num_kv_heads = 1  # the shared latent
        bias = cfg.qkv_bias
        q_out, kv_a = cfg.num_heads * m.qk_head_dim, m.kv_lora_rank + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, [q_out])
            self.kv_a_proj_with_mqa = ColumnParallelLinear(cfg.hidden_size, [kv_a], bias,
                                                           replicas=[tp])
        else:  # q_a and kv_a read the same x: one matrix (`fused_qkv_a`), one launch
            self.qkv_a_proj = ColumnParallelLinear(cfg.hidden_size, [m.q_lora_rank, kv_a],
                                                   bias, replicas=[tp, tp])
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, [q_out])
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            m.kv_lora_rank, [cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim)])
        self.o_proj = RowParallelLinear(cfg.num_heads * m.v_head_dim, cfg.hidden_size,
                                        bias=cfg.o_bias)
        self.scale = m.qk_head_dim ** -0.5 * softmax_mscale(cfg.rope) ** 2

    def forward(self, x: torch.Tensor, rope: RopeTables, backend: AttentionBackend
                ) -> torch.Tensor:
        # x: [n, hidden]; rope: cos, sin [n, 1, qk_rope_head_dim]
        m, n, heads = self.m, x.shape[0], self.num_heads
        if m.q_lora_rank is None:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        else:
            q_a, kv_a = self.qkv_a_proj(x).split([m.q_lora_rank, m.latent_dim], dim=-1)
            q = self.q_b_proj(q_a, norm=self.q_a_layernorm)
        q_nope, q_pe = q.view(n, heads, m.qk_head_dim).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        w = self.kv_b_proj.weight.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)  # [n, heads, kv_lora_rank]
        norm = self.kv_a_layernorm
        if fused_kernels_apply(x) and isinstance(backend, AttentionBackend):
            # One kernel: the norm, both RoPEs, the cache write and the query's concatenation.
            from flashtree.layers.fused_mla import mla_prologue

            q_full = mla_prologue(q_latent, q_pe, kv_a, *rope, norm.weight, norm.eps,
                                  backend.cache.k[self.layer], backend.slot_mapping,
                                  m.rope_interleave)
            out = backend.attend_latent(self.layer, q_full, m.kv_lora_rank, self.scale)
        else:
            c, k_pe = kv_a.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
            c = norm(c).view(n, 1, m.kv_lora_rank)
            k_pe = k_pe.reshape(n, 1, m.qk_rope_head_dim)
            if m.rope_interleave:
                q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
            q_pe, k_pe = apply_rotary(q_pe, *rope), apply_rotary(k_pe, *rope)
            out = backend.forward_latent(
                self.layer,
                torch.cat([q_latent, q_pe], dim=-1),  # [n, heads, latent_dim]
                torch.cat([c, k_pe], dim=-1),  # [n, 1, latent_dim]
                m.kv_lora_rank, self.scale,
            )  # [n, heads, kv_lora_rank]
        out = torch.einsum("nhc,hvc->nhv", out, w_uv)  # [n, heads, v_head_dim]
        return self.o_proj(out.reshape(n, heads * m.v_head_dim))


class DeepseekV3Layer(MoEDecoderLayer):
    def make_attention(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return MLAttention(cfg, layer)


class DeepseekV3Model(DecoderModel):
    layer_cls = DeepseekV3Layer
    stacked = {".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        assert cfg.mla is not None
        if cfg.mla.q_lora_rank is not None:  # MLAttention's fused q_a / kv_a
            self.stacked = {**self.stacked, ".q_a_proj": (".qkv_a_proj", 0),
                            ".kv_a_proj_with_mqa": (".qkv_a_proj", 1)}

    def kv_cache_dims(self) -> tuple[int, int, int]:
        assert self.cfg.mla is not None
        return 1, self.cfg.mla.latent_dim, 0  # key-only latent cache

    def _skip_tensor(self, name: str) -> bool:
        return skip_moe_tensor(self, name)
