"""DFlash drafter training by target-aligned distillation (the published recipe).

Data: the target regenerates responses to a prompt set with flashtree's own batched generation.
Training: per sequence, random anchors p; each anchor spawns the block `[x_p, mask x (B-1)]` at
positions p..p+B-1 that sees the target's context features of positions strictly before p plus
its own block (bidirectional), exactly what inference sees. Cross-entropy at slots k = 1..B-1,
weighted exp(-(k-1)/gamma), against either the data token x_{p+k} (`labels="tokens"`, the
published recipe) or the target's own next-token distribution at p+k-1 (`labels="target"`, the
default: soft labels that carry the target's argmax even where the data token was sampled, and
its whole distribution for sampled decoding). The target (embedding, LM head, features) is
frozen; the draft layers, fc, hidden_norm and norm train with AdamW. The drafter is written in
the z-lab format, loadable by flashtree and by the reference `dflash` package."""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from flashtree.kv.cache import KVCache, PageTables
from flashtree.llm import LLM
from flashtree.models.config import ModelConfig
from flashtree.models.dflash import DFlashConfig, DFlashDraftModel, default_target_layer_ids
from flashtree.models.llama import DecoderModel
from flashtree.runner.forward_batch import BatchItem, Mode
from flashtree.runner.model_runner import ModelRunner
from flashtree.sampling import SamplingParams
from flashtree.train import distributed
from flashtree.train.prompts import first_line_prompt

# A time budget fixes the run's length from the speed of steps WARMUP..TIMED (the first steps
# pay one-time costs: allocator growth, kernel selection).
_TIMING_WARMUP, _TIMING_STEPS = 10, 30
LABELS = ("target", "tokens")


@dataclass(frozen=True)
class TrainConfig:
    block_size: int = 16
    num_layers: int = 4
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    steps: int = 2000
    batch_size: int = 16  # sequences per step
    anchors: int = 32  # blocks per sequence per step
    lr: float = 6e-4
    warmup: float = 0.04
    grad_clip: float = 1.0
    gamma: float | None = None  # slot weight decay; default 7 * block_size / 16
    log_every: int = 50
    save_every: int = 0  # also write the drafter every this many steps (0: only at the end)
    time_budget: float | None = None  # seconds; fits the step count (and LR schedule) into it
    max_shard_mb: float = 0  # split model.safetensors into shards of at most this (0: one file)
    seed: int = 0
    init_from_target: bool = True  # start draft layers from the target's last layers
    init_from: str | None = None  # continue training a drafter saved earlier (same geometry)
    val_examples: int = 0  # examples held out to log validation loss/accuracy (overfitting)
    labels: str = "target"  # "target": the target's next-token distribution; "tokens": the data

    @property
    def soft_labels(self) -> bool:
        return self.labels == "target"

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        for name in ("num_layers", "steps", "batch_size", "anchors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.val_examples < 0:
            raise ValueError(f"val_examples must be >= 0, got {self.val_examples}")
        if self.labels not in LABELS:
            raise ValueError(f"labels must be one of {LABELS}, got {self.labels!r}")


@dataclass
class Example:
    tokens: list[int]
    response_start: int  # index of the first generated token


# ---------------------------------------------------------------------- data
def _encode_prompts(llm: LLM, prompts: list[str] | list[list[int]], chat: bool) -> list[list[int]]:
    if chat and prompts and isinstance(prompts[0], str):
        assert llm.tokenizer is not None, "chat prompts need a tokenizer"
        return [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                for p in prompts]
    return [llm._encode(p) for p in prompts]


def generate_examples(
    llm: LLM, prompts: list[str] | list[list[int]], max_new_tokens: int, chat: bool = True,
    temperature: float | list[float] = 0.0, seed: int = 0,
) -> list[Example]:
    """The target's own responses to `prompts` (target-aligned distillation data), at one
    temperature or one per prompt; request i samples with seed `seed + i`."""
    temps = temperature if isinstance(temperature, list) else [temperature] * len(prompts)
    params = [SamplingParams(temperature=t, max_tokens=max_new_tokens, seed=seed + i)
              for i, t in enumerate(temps)]
    outs = llm.generate(_encode_prompts(llm, prompts, chat), params)
    return [Example(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids))
            for o in outs if len(o.outputs[0].token_ids) >= 2]


def self_instruct_prompts(
    llm: LLM, requests: list[str], max_new_tokens: int = 64, temperature: float = 0.7,
    seed: int = 0,
) -> list[str]:
    """Prompts written by the target itself in reply to `requests` (see
    `prompts.self_instruct_requests`): the first line of each reply, repeats dropped."""
    params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed + i)
              for i in range(len(requests))]
    outs = llm.generate(_encode_prompts(llm, requests, chat=True), params)
    found = (first_line_prompt(o.outputs[0].text) for o in outs)
    return list(dict.fromkeys(p for p in found if p))


def save_examples(path: str | Path, examples: list[Example]) -> None:
    """All examples in one compressed file: flat tokens, per-example lengths and starts."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path, tokens=np.fromiter((t for ex in examples for t in ex.tokens), dtype=np.int32),
        lengths=np.array([len(ex.tokens) for ex in examples], dtype=np.int64),
        response_start=np.array([ex.response_start for ex in examples], dtype=np.int64))


def load_examples(path: str | Path) -> list[Example]:
    with np.load(path) as data:  # each item access decompresses: read every array once
        tokens, lengths, starts = data["tokens"], data["lengths"], data["response_start"]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [Example(tokens[a:b].tolist(), int(r))
            for a, b, r in zip(bounds[:-1], bounds[1:], starts)]


# ---------------------------------------------------------------------- model setup
def pick_mask_token_id(llm: LLM) -> int:
    """A token that exists in the target vocabulary but never appears in chat traffic: the
    highest special token id other than BOS/EOS/PAD and the chat template's markers."""
    cfg = llm.model_config
    if llm.tokenizer is None:
        return cfg.vocab_size - 1
    hf = llm.tokenizer.hf
    used = {hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, *cfg.eos_token_ids}
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    used |= set(llm.tokenizer.apply_chat_template(probe))
    special = [i for i in getattr(hf, "all_special_ids", []) if i not in used]
    special += [i for i in getattr(hf, "added_tokens_decoder", {}) if i not in used]
    return max(special) if special else cfg.vocab_size - 1


def drafter_hf_config(target: ModelConfig, cfg: TrainConfig, mask_id: int) -> dict:
    layer_ids = list(cfg.target_layer_ids or default_target_layer_ids(target.num_layers,
                                                                      cfg.num_layers))
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": {"target_layer_ids": layer_ids, "mask_token_id": mask_id},
        "num_target_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope.theta,
        "rope_scaling": None,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    }


def new_drafter(target: DecoderModel, hf_cfg: dict, cfg: TrainConfig) -> DFlashDraftModel:
    dcfg = DFlashConfig.from_hf(hf_cfg)
    dcfg.check_target(target.cfg)
    device = target.norm.weight.device
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.device(device):
        draft = DFlashDraftModel(dcfg)
    for name, p in draft.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    if cfg.init_from is not None:
        from flashtree.models.loader import iter_safetensors, safetensors_files

        draft.load_weights(iter_safetensors(safetensors_files(Path(cfg.init_from))))
    elif cfg.init_from_target:
        offset = len(target.layers) - len(draft.layers)
        for i, layer in enumerate(draft.layers):
            src = target.layers[offset + i].state_dict()
            layer.load_state_dict(src, strict=False)  # q/k norms stay at one
    draft.float()
    for p in draft.parameters():
        p.requires_grad_(True)
    return draft


# ---------------------------------------------------------------------- training batch
class BlockAttention:
    """Attention for a training batch: block queries of each sequence see the context K/V of
    positions strictly before their anchor, plus their own block (bidirectional)."""

    def __init__(self, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
                 shape: tuple[int, int]) -> None:
        self.ctx_kv = ctx_kv  # per layer (k, v): [S, T, kv_heads, hd]
        self.mask = mask  # [S, 1, Q, T + Q] bool
        self.seqs, self.queries = shape

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        s, n = self.seqs, self.queries
        ck, cv = self.ctx_kv[layer]
        keys = torch.cat([ck, k.view(s, n, *k.shape[1:])], dim=1).transpose(1, 2)
        values = torch.cat([cv, v.view(s, n, *v.shape[1:])], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.view(s, n, *q.shape[1:]).transpose(1, 2), keys, values, attn_mask=self.mask,
            enable_gqa=True,
        )
        return out.transpose(1, 2).reshape(s * n, *q.shape[1:])


def training_runner(target: DecoderModel, capture_layers: tuple[int, ...], seqs: int,
                    width: int) -> ModelRunner:
    """A runner whose paged cache holds `seqs` sequences of up to `width` tokens and whose
    forwards return the outputs of `capture_layers` for every token."""
    page = 16
    pages = PageTables(seqs * (-(-width // page)), page)
    kv_heads, k_dim, v_dim = target.kv_cache_dims()
    cache = KVCache(target.cfg.num_layers, pages.num_pages, page, kv_heads, k_dim,
                    target.norm.weight.dtype, target.norm.weight.device, v_head_dim=v_dim)
    return ModelRunner(target, cache, pages, capture_layers)


def target_features(runner: ModelRunner, examples: list[Example], width: int) -> torch.Tensor:
    """Outputs of the runner's capture layers for every token, zero past each sequence's end:
    [S, T, layers * hidden] float32, an ordinary tensor (the forward's own outputs are
    inference tensors, which autograd could not use)."""
    pages = runner.pages
    items = []
    for i, ex in enumerate(examples):
        pages.reserve(i, len(ex.tokens))
        items.append(BatchItem(i, 0, ex.tokens, wants_logits=False))
    _, feats = runner.forward(Mode.PREFILL, items)
    assert feats is not None
    out = torch.zeros(len(examples), width, feats.shape[-1], device=feats.device)
    row = 0
    for i, ex in enumerate(examples):
        out[i, : len(ex.tokens)] = feats[row : row + len(ex.tokens)].float()
        row += len(ex.tokens)
        pages.free(i)
    return out


def block_loss(
    draft: DFlashDraftModel, target: DecoderModel, examples: list[Example],
    features: torch.Tensor, cfg: TrainConfig, rng: random.Random,
    last_hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """Weighted cross-entropy of one batch; returns (loss, top-1 accuracy at slot 1).
    features: [S, T, taps * hidden]; last_hidden: [S, T, hidden] outputs of the target's last
    decoder layer, given for soft labels (the target's distributions), else data tokens."""
    device = features.device
    s, t = features.shape[:2]
    b, a = cfg.block_size, cfg.anchors
    gamma = cfg.gamma or 7.0 * b / 16
    anchors = torch.zeros(s, a, dtype=torch.long)
    valid_anchor = torch.zeros(s, a, dtype=torch.bool)
    tokens = torch.zeros(s, t + b, dtype=torch.long)
    lengths = torch.tensor([len(ex.tokens) for ex in examples])
    for i, ex in enumerate(examples):
        tokens[i, : len(ex.tokens)] = torch.tensor(ex.tokens)
        # The bonus x_p is a generated token and x_{p+1} must exist (inference's first block
        # starts at the first generated token).
        candidates = list(range(ex.response_start, len(ex.tokens) - 1))
        chosen = sorted(rng.sample(candidates, min(a, len(candidates))))
        anchors[i, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
        valid_anchor[i, : len(chosen)] = True
    anchors, valid_anchor = anchors.to(device), valid_anchor.to(device)
    tokens, lengths = tokens.to(device), lengths.to(device)
    j = torch.arange(b, device=device)
    pos = anchors[:, :, None] + j  # [S, A, B]
    ids = torch.full((s, a, b), draft.cfg.mask_token_id, dtype=torch.long, device=device)
    ids[:, :, 0] = tokens.gather(1, anchors)
    labels = tokens.gather(1, pos.clamp(max=t + b - 1).view(s, -1)).view(s, a, b)
    weight = torch.exp(-(j - 1).clamp(min=0) / gamma) * (j >= 1)
    supervised = (pos < lengths[:, None, None]) & valid_anchor[:, :, None] & (j >= 1)
    # Visibility: context positions < anchor (and inside the sequence); own block only.
    q_anchor = anchors[:, :, None].expand(s, a, b).reshape(s, a * b)
    ctx_visible = torch.arange(t, device=device)[None, None, :] < q_anchor[:, :, None]
    block_of = torch.arange(a * b, device=device) // b
    own_block = block_of[:, None] == block_of[None, :]
    mask = torch.cat([ctx_visible, own_block.expand(s, -1, -1)], dim=2)[:, None]

    ctx_pos = torch.arange(t, device=device).repeat(s)
    ctx_kv = [(k.view(s, t, *k.shape[1:]), v.view(s, t, *v.shape[1:]))
              for k, v in draft.context_kv(features.view(s * t, -1), ctx_pos)]
    attn = BlockAttention(ctx_kv, mask, (s, a * b))
    embeds = target.embed_tokens(ids.view(-1)).float()
    hidden = draft(embeds, pos.view(-1), [attn] * len(draft.layers))
    hidden = hidden.view(s, a, b, -1)[:, :, 1:]  # slots 1..B-1
    logits = draft.logits(hidden.to(target.lm_head.weight.dtype), target.lm_head)
    logits = logits.reshape(-1, logits.shape[-1])  # [S * A * (B-1), vocab]
    if last_hidden is None:
        hard = labels[:, :, 1:].reshape(-1)
        ce = F.cross_entropy(logits, hard, reduction="none")
    else:
        teacher = target_log_probs(target, last_hidden, pos[:, :, 1:] - 1)
        hard = teacher.argmax(-1)
        ce = F.cross_entropy(logits, teacher.exp(), reduction="none")
    w = weight[1:] * supervised[:, :, 1:]
    loss = (ce.view(s, a, b - 1) * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        first = supervised[:, :, 1]
        hit = (logits.view(s, a, b - 1, -1)[:, :, 0].argmax(-1)
               == hard.view(s, a, b - 1)[:, :, 0]) & first
        acc = float(hit.sum() / first.sum().clamp(min=1))
    return loss, acc


@torch.no_grad()
def target_log_probs(target: DecoderModel, last_hidden: torch.Tensor,
                     at: torch.Tensor) -> torch.Tensor:
    """The target's next-token log-probabilities [n, vocab] (float32) at positions `at`
    [S, ...] of each sequence, from its last decoder layer's outputs [S, T, hidden]; positions
    past T read row T-1 (like the padding rows past a sequence's end, never supervised)."""
    s, t = last_hidden.shape[:2]
    rows = at.reshape(s, -1).clamp(max=t - 1)
    h = last_hidden.gather(1, rows[:, :, None].expand(-1, -1, last_hidden.shape[-1]))
    h = h.reshape(-1, last_hidden.shape[-1]).to(target.norm.weight.dtype)
    return F.log_softmax(target.compute_logits(target.norm(h)), dim=-1)


def captured_layers(draft: DFlashDraftModel, target: DecoderModel,
                    cfg: TrainConfig) -> tuple[int, ...]:
    """The target layers a training pass captures: the drafter's, then (soft labels) the
    target's last layer, whose outputs give the target's distributions."""
    last_layer = (target.cfg.num_layers - 1,) if cfg.soft_labels else ()
    return tuple(draft.cfg.target_layer_ids) + last_layer


def batch_loss(
    draft: DFlashDraftModel, target: DecoderModel, runner: ModelRunner, chosen: list[Example],
    cfg: TrainConfig, rng: random.Random,
) -> tuple[torch.Tensor, float]:
    """The target pass and the block loss of one batch; `runner` captures `captured_layers`."""
    captured = target_features(runner, chosen, max(len(ex.tokens) for ex in chosen))
    taps = len(draft.cfg.target_layer_ids) * target.cfg.hidden_size
    features = captured[..., :taps].contiguous()  # [S, T, taps * hidden]
    last_hidden = captured[..., taps:] if cfg.soft_labels else None  # [S, T, hidden]
    # bf16 compute on GPUs, fp32 master weights and optimizer state.
    with torch.autocast("cuda", torch.bfloat16, enabled=captured.is_cuda):
        return block_loss(draft, target, chosen, features, cfg, rng, last_hidden)


# ---------------------------------------------------------------------- loop and save
def train_drafter(
    llm: LLM, examples: list[Example], out_dir: str | Path, cfg: TrainConfig,
    progress: bool = True,
) -> DFlashDraftModel:
    target = llm.model
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else pick_mask_token_id(llm)
    hf_cfg = drafter_hf_config(llm.model_config, cfg, mask_id)
    draft = new_drafter(target, hf_cfg, cfg)
    params = list(draft.parameters())
    rank, world = distributed.rank_and_world()
    lead = rank == 0  # the rank that validates, logs and saves
    if world > 1:
        distributed.broadcast_parameters(params)
    if not examples:
        raise ValueError("no training examples: every generated response was shorter than 2")
    width = max(len(ex.tokens) for ex in examples)
    val: list[Example] = []
    if cfg.val_examples:
        if cfg.val_examples >= len(examples):
            raise ValueError(f"val_examples={cfg.val_examples} leaves no training examples "
                             f"out of {len(examples)}")
        shuffled = random.Random(cfg.seed + 1).sample(examples, len(examples))
        val, examples = shuffled[: cfg.val_examples], shuffled[cfg.val_examples :]
        val = val if lead else []
    batch = min(cfg.batch_size, len(examples))
    runner = training_runner(target, captured_layers(draft, target, cfg), batch, width)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    warm = max(1, int(cfg.warmup * cfg.steps))

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    rng = random.Random(cfg.seed + 7919 * rank)  # each rank its own batches and anchors
    order: list[int] = []
    total = cfg.steps
    bar = _progress(total, progress and lead)

    def log(line: str) -> None:
        if lead:
            _log(bar, line)

    if world > 1:
        log(f"{world} processes, {batch} sequences each per step")
    start, running = time.time(), []
    val_cost = 0.0  # seconds of one validation pass, part of every log_every steps
    if val:  # the starting point, and what a validation pass costs
        val_loss, val_acc = _validate(draft, target, runner, val, cfg, batch)
        val_cost = time.time() - start
        log(f"step 0/{total} | val loss {val_loss:.4f} acc@1 {val_acc:.3f}")
    step = 0
    while step < total:
        if len(order) < batch:
            order += rng.sample(range(len(examples)), len(examples))
        chosen = [examples[order.pop()] for _ in range(batch)]
        loss, acc = batch_loss(draft, target, runner, chosen, cfg, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            distributed.average_gradients(params)
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        running.append((loss.item(), acc))
        bar.update(1)
        if step + 1 == _TIMING_WARMUP:
            warmed = time.time()
        refit = step + 1 == _TIMING_STEPS or (step + 1 > _TIMING_STEPS
                                               and (step + 1) % cfg.log_every == 1)
        if cfg.time_budget is not None and refit:
            # Fit the run (and its cosine schedule) to what the time budget allows; refitted
            # after each validation, whose cost the first estimate only guesses (the start-up
            # pass includes compilation).
            done = step + 1 - _TIMING_WARMUP
            per_step = (time.time() - warmed) / done
            if step + 1 == _TIMING_STEPS:
                per_step += val_cost / cfg.log_every
            left = (cfg.time_budget - (time.time() - start)) / per_step
            total = max(step + 2, min(cfg.steps, step + 1 + int(left)))
            if world > 1:  # the ranks' speeds differ (rank 0 validates): the slowest decides
                total = distributed.agree_on_min(total, runner.device)
            bar.total = total
            if step + 1 == _TIMING_STEPS:
                warm = max(1, int(cfg.warmup * total))
                log(f"{per_step:.3f}s per step: training {total} steps")
        if (step + 1) % cfg.log_every == 0 or step + 1 == total:
            mean_loss = sum(x for x, _ in running) / len(running)
            mean_acc = sum(y for _, y in running) / len(running)
            line = (f"step {step + 1}/{total} loss {mean_loss:.4f} acc@1 {mean_acc:.3f} "
                    f"lr {sched.get_last_lr()[0]:.2e} {time.time() - start:.0f}s")
            if val:
                val_loss, val_acc = _validate(draft, target, runner, val, cfg, batch)
                line += f" | val loss {val_loss:.4f} acc@1 {val_acc:.3f}"
            log(line)
            running = []
        if lead and cfg.save_every and (step + 1) % cfg.save_every == 0:
            save_drafter(draft, hf_cfg, out_dir, cfg.max_shard_mb)
        step += 1
    bar.close()
    if world > 1:
        distributed.check_in_step(params)
    if lead:
        save_drafter(draft, hf_cfg, out_dir, cfg.max_shard_mb)
    return draft.eval()


@torch.no_grad()
def _validate(draft: DFlashDraftModel, target: DecoderModel, runner: ModelRunner,
              val: list[Example], cfg: TrainConfig, batch: int) -> tuple[float, float]:
    """Mean loss and slot-1 accuracy on the held-out examples (same anchors every time)."""
    rng = random.Random(cfg.seed)
    results = []
    for i in range(0, len(val), batch):
        loss, acc = batch_loss(draft, target, runner, val[i : i + batch], cfg, rng)
        results.append((loss.item(), acc))
    return (sum(x for x, _ in results) / len(results), sum(y for _, y in results) / len(results))


def save_drafter(
    draft: DFlashDraftModel, hf_cfg: dict, out_dir: str | Path, max_shard_mb: float = 0
) -> None:
    """z-lab layout: config.json + model.safetensors (bf16), names without a `model.` prefix,
    q/k/v and gate/up unstacked; with `max_shard_mb`, Hugging Face shards plus their index."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in draft.state_dict().items():
        w = p.detach().to(torch.bfloat16).cpu()
        if ".qkv_proj." in name:
            attn = draft.layers[int(name.split(".")[1])].self_attn
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"),
                                   w.split(attn.qkv_proj.shard_sizes, dim=0)):
                tensors[name.replace("qkv_proj", part)] = chunk.contiguous()
        elif ".gate_up_proj." in name:
            gate, up = w.chunk(2, dim=0)
            tensors[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            tensors[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            tensors[name] = w.contiguous()
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}]
    limit = max_shard_mb * 2**20
    for name, w in tensors.items():
        size = sum(t.numel() * t.element_size() for t in shards[-1].values())
        if limit and shards[-1] and size + w.numel() * w.element_size() > limit:
            shards.append({})
        shards[-1][name] = w
    if len(shards) == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        index = {"metadata": {"total_size": sum(t.numel() * 2 for t in tensors.values())},
                 "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")


def _log(bar, line: str) -> None:
    """Progress lines go to stdout (the bar lives on stderr), so logs can be kept apart."""
    bar.clear()
    print(line, flush=True)
    bar.refresh()


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc="train-drafter", dynamic_ncols=True)
