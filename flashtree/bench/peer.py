"""The compiled-PyTorch peer of flashtree's decode step, written as gpt-fast writes it, for the
speculative benchmark's steps section: a plain Qwen3 decoder over a static KV cache, attention
by SDPA, one decode step compiled with `torch.compile(mode="reduce-overhead", fullgraph=True)`,
reading a flashtree Qwen3 `DecoderModel`'s weights in place, so both decode the same model."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; x [B, H, 1, D], cos/sin [1, 1, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class CompiledPeer(torch.nn.Module):
    """flashtree's decode step as gpt-fast writes it: a plain Qwen3 decoder over a static KV
    cache [batch, kv_heads, max_len, head_dim] per layer (buffers of random values, so the
    compiled step may write them and replay as a CUDA graph), attention by SDPA over the whole
    cache under a position mask, compiled with `mode="reduce-overhead", fullgraph=True`. It
    reads the flashtree model's weights in place, so both decode the same model."""

    def __init__(self, model, cfg, batch: int, ctx: int, max_len: int) -> None:
        super().__init__()
        self.model, self.batch = model, batch
        weight = model.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        self.heads, self.kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim, self.eps = cfg.head_dim, cfg.rms_norm_eps
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        for i in range(len(model.layers)):
            self.register_buffer(f"k{i}", torch.randn(shape, device=device, dtype=dtype))
            self.register_buffer(f"v{i}", torch.randn(shape, device=device, dtype=dtype))
        inv = 1.0 / (cfg.rope.theta ** (torch.arange(0, self.head_dim, 2, device=device)
                                        .float() / self.head_dim))
        angles = torch.outer(torch.arange(max_len, device=device).float(), inv)
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, dim=-1))  # [max_len, D]
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, dim=-1))
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.full((1,), ctx, dtype=torch.long, device=device)
        self.step = torch.compile(self.forward, mode="reduce-overhead", fullgraph=True)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        m, b, d = self.model, self.batch, self.head_dim
        x = F.embedding(tokens, m.embed_tokens.weight)  # [B, 1, hidden]
        cos, sin = self.cos[pos].view(1, 1, 1, -1), self.sin[pos].view(1, 1, 1, -1)
        mask = (torch.arange(self.cos.shape[0], device=pos.device) <= pos)[None, None, None]
        q_size, kv_size = self.heads * d, self.kv_heads * d
        for i, layer in enumerate(m.layers):
            attn, k_cache, v_cache = layer.self_attn, getattr(self, f"k{i}"), getattr(self, f"v{i}")
            h = _rms(x, layer.input_layernorm.weight, self.eps)
            q, k, v = F.linear(h, attn.qkv_proj.weight).split([q_size, kv_size, kv_size], dim=-1)
            q = _rms(q.view(b, 1, self.heads, d), attn.q_norm.weight, self.eps)
            k = _rms(k.view(b, 1, self.kv_heads, d), attn.k_norm.weight, self.eps)
            q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v.view(b, 1, self.kv_heads, d).transpose(1, 2))
            o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
                                               enable_gqa=True)
            x = x + F.linear(o.transpose(1, 2).reshape(b, 1, q_size), attn.o_proj.weight)
            h = _rms(x, layer.post_attention_layernorm.weight, self.eps)
            gate, up = F.linear(h, layer.mlp.gate_up_proj.weight).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
        x = _rms(x, m.norm.weight, self.eps)
        return F.linear(x, m.lm_head.weight).argmax(dim=-1)  # [B, 1] next tokens

    def decode(self) -> torch.Tensor:
        """One compiled decode step at position ctx."""
        return self.step(self.tokens, self.pos)
