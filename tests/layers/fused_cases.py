"""Random cases for the fused Triton kernels (`flashtree/layers/fused.py`), shared by the
CPU-interpreter and CUDA tests, each against transformers' own modules: `LlamaRMSNorm` (also
Qwen3's per-head q/k norm), `apply_rotary_pos_emb`, and `LlamaMLP`'s SiLU-gated product."""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from flashtree.layers import fused

DTYPES = [torch.float32, torch.bfloat16]
# bf16: two units in the last place (two roundings, each of which the interpreter does by
# truncation and the compiled kernels to nearest; float32 reduction order differs too).
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.bfloat16: dict(rtol=2 ** -6, atol=2 ** -6)}


def _reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(device=x.device, dtype=x.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)


def check_rms_norm(dtype: torch.dtype, device: str, dim: int, residual: bool, heads: int,
                   seed: int = 0) -> None:
    """[n, dim] rows with or without a residual, or [n, heads, dim] rows cut from a wider
    projection output (strided, as q/k come out of the stacked qkv projection)."""
    torch.manual_seed(seed)
    n, eps = 7, 1e-6
    weight = torch.randn(dim, device=device).to(dtype)
    if heads:
        wide = torch.randn(n, heads * dim + 5, device=device).to(dtype)
        x = wide[:, 3:3 + heads * dim].view(n, heads, dim)  # [n, heads, dim], row stride != dim
    else:
        x = torch.randn(n, dim, device=device).to(dtype) * 3
    res = torch.randn(n, dim, device=device).to(dtype) if residual else None
    out, total = fused.rms_norm(x, weight, eps, res)
    expected_total = x + res if res is not None else None
    if expected_total is not None:
        assert total is not None
        torch.testing.assert_close(total, expected_total, **TOLERANCE[dtype])
    else:
        assert total is None
    source = expected_total if expected_total is not None else x
    torch.testing.assert_close(out, _reference_norm(source, weight, eps), **TOLERANCE[dtype])


def check_silu_mul(dtype: torch.dtype, device: str, inter: int, seed: int = 0) -> None:
    torch.manual_seed(seed)
    gate_up = torch.randn(5, 2 * inter, device=device).to(dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    expected = ACT2FN["silu"](gate) * up  # LlamaMLP: down(act(gate(x)) * up(x))
    torch.testing.assert_close(fused.silu_mul(gate_up), expected, **TOLERANCE[dtype])


def check_norm_rope(dtype: torch.dtype, device: str, head_dim: int, with_norm: bool,
                    seed: int = 0) -> None:
    """q and k heads cut from one qkv row (strided), rotated at scattered positions."""
    torch.manual_seed(seed)
    n, q_heads, kv_heads, eps = 6, 4, 2, 1e-6
    qkv = torch.randn(n, (q_heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q = qkv[:, : q_heads * head_dim].view(n, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim: (q_heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (n,), device=device).float()
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    freqs = positions[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [n, 1, head_dim] float32
    cos, sin = emb.cos(), emb.sin()
    q_weight = torch.randn(head_dim, device=device).to(dtype)
    k_weight = torch.randn(head_dim, device=device).to(dtype)
    if with_norm:
        ours_q = fused.norm_rope(q, cos, sin, q_weight, eps)
        ours_k = fused.norm_rope(k, cos, sin, k_weight, eps)
        q, k = _reference_norm(q, q_weight, eps), _reference_norm(k, k_weight, eps)
    else:
        ours_q, ours_k = fused.norm_rope(q, cos, sin), fused.norm_rope(k, cos, sin)
    # transformers' layout: [batch, heads, seq, head_dim], cos/sin [batch, seq, head_dim]; the
    # rotation in float32, rounded once (transformers rounds cos/sin to bf16 first).
    ref_q, ref_k = apply_rotary_pos_emb(q.float().transpose(0, 1)[None],
                                        k.float().transpose(0, 1)[None],
                                        cos[None, :, 0], sin[None, :, 0])
    torch.testing.assert_close(ours_q, ref_q[0].transpose(0, 1).to(dtype), **TOLERANCE[dtype])
    torch.testing.assert_close(ours_k, ref_k[0].transpose(0, 1).to(dtype), **TOLERANCE[dtype])


def check_norm_rope_to_cache(dtype: torch.dtype, device: str, head_dim: int, with_norm: bool,
                             layers: int = 0, seed: int = 0) -> None:
    """Keys roped (after the norm) straight into scattered cache rows and values copied beside
    them; every other cache row keeps its contents. `layers` > 0: `norm_rope_to_layer_caches`
    writes that many layers' caches at once, from one projection output holding every layer's
    k and v rows (each layer its own norm weight), as the drafter's context write does."""
    torch.manual_seed(seed)
    n, kv_heads, slots_total, eps = 5, 2, 23, 1e-6
    count = max(layers, 1)
    kv = torch.randn(n, count, 2 * kv_heads, head_dim, device=device).to(dtype)
    k, v = kv.chunk(2, dim=2)  # [n, count, kv_heads, head_dim], strided
    k_cache = torch.randn(count, slots_total, kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn(count, slots_total, kv_heads, head_dim, device=device).to(dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(slots_total, device=device)[:n]
    emb = torch.rand(n, 1, head_dim // 2, device=device) * 100
    emb = torch.cat((emb, emb), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    weights = torch.randn(count, head_dim, device=device).to(dtype) if with_norm else None
    if layers:
        fused.norm_rope_to_layer_caches(k, v, cos, sin, k_cache, v_cache, slots, weights, eps)
    else:
        fused.norm_rope_to_cache(k[:, 0], v[:, 0], cos, sin, k_cache[0], v_cache[0], slots,
                                 None if weights is None else weights[0], eps)
    others = torch.ones(slots_total, dtype=torch.bool, device=device)
    others[slots] = False
    for layer in range(count):
        source = k[:, layer]
        if weights is not None:
            source = _reference_norm(source, weights[layer], eps)
        ref_k, _ = apply_rotary_pos_emb(source.float().transpose(0, 1)[None],
                                        source.float().transpose(0, 1)[None],
                                        cos[None, :, 0], sin[None, :, 0])
        torch.testing.assert_close(k_cache[layer, slots], ref_k[0].transpose(0, 1).to(dtype),
                                   **TOLERANCE[dtype])
        assert torch.equal(v_cache[layer, slots], v[:, layer])
        assert torch.equal(k_cache[layer, others], before_k[layer, others])
        assert torch.equal(v_cache[layer, others], before_v[layer, others])


def check_mla_prologue(dtype: torch.dtype, device: str, interleaved: bool, latent: int = 32,
                       rope: int = 8, heads: int = 3, seed: int = 0) -> None:
    """`fused_mla.mla_prologue` against transformers' DeepSeek-V3 pieces: the latent normed by
    `DeepseekV3RMSNorm` and the shared key roped (`apply_rotary_pos_emb_interleave`, or the
    rotate-half RoPE for checkpoints without interleave) land in scattered cache rows, every
    other row kept; the query is q_latent (a strided view, as the absorbing einsum returns it)
    beside each head's roped q_pe, cut from the q_b projection's rows."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RMSNorm,
        apply_rotary_pos_emb_interleave,
    )

    from flashtree.layers.fused_mla import mla_prologue

    torch.manual_seed(seed)
    n, nope, slots_total, eps = 5, 6, 17, 1e-6
    q = torch.randn(n, heads * (nope + rope), device=device).to(dtype)
    q_pe = q.view(n, heads, nope + rope)[..., nope:]
    q_latent = torch.randn(heads, n, latent, device=device).to(dtype).transpose(0, 1)
    kv_a = torch.randn(n, 3 + latent + rope, device=device).to(dtype)[:, 3:] * 2
    cache = torch.randn(slots_total, 1, latent + rope, device=device).to(dtype)
    before = cache.clone()
    slots = torch.randperm(slots_total, device=device)[:n]
    emb = torch.rand(n, 1, rope // 2, device=device) * 100
    emb = torch.cat((emb, emb), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    weight = torch.randn(latent, device=device).to(dtype)

    out = mla_prologue(q_latent, q_pe, kv_a, cos, sin, weight, eps, cache, slots, interleaved)

    norm = DeepseekV3RMSNorm(latent, eps).to(device=device, dtype=dtype)
    norm.weight.data.copy_(weight)
    rotate = apply_rotary_pos_emb_interleave if interleaved else apply_rotary_pos_emb
    # [batch 1, heads, n, rope] in float32 against cos/sin [1, n, rope], rounded once.
    ref_q, ref_k = rotate(q_pe.float().transpose(0, 1)[None], kv_a[:, latent:].float()[None, None],
                          cos[None, :, 0], sin[None, :, 0])
    assert torch.equal(out[..., :latent], q_latent)
    torch.testing.assert_close(out[..., latent:], ref_q[0].transpose(0, 1).to(dtype),
                               **TOLERANCE[dtype])
    torch.testing.assert_close(cache[slots, 0, :latent], norm(kv_a[:, :latent]),
                               **TOLERANCE[dtype])
    torch.testing.assert_close(cache[slots, 0, latent:], ref_k[0, 0].to(dtype),
                               **TOLERANCE[dtype])
    others = torch.ones(slots_total, dtype=torch.bool, device=device)
    others[slots] = False
    assert torch.equal(cache[others], before[others])
