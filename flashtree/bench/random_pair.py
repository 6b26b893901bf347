"""Random-weight targets and DFlash drafters of real shapes (`flashtree/bench/shapes.py`): built
on the device as modules (`random_target`, `random_drafter`, served by `LLM.from_modules`), or
written as Hugging Face checkpoints (`save_target`, `save_drafter`) for what must load from a
path (tensor-parallel ranks, transformers, the reference `dflash` package). Both fill every
tensor by the same rule (`_random`).

The target is made decisive, so that plain decoding, chain verify and tree verify pick the
same greedy token although their kernels round differently. Scaling the LM head alone cannot
do that: rounding errors scale with the logits. Instead the residual stream stays close to the
current token's embedding (unit-variance embeddings, small output projections) and the LM head
is the embedding table in a random order: the next token is the permutation's image of the
current one, with a top-2 logit gap of about `hidden_size` against noise of a few units
(`top2_gaps` measures it). Every matrix keeps its real shape, so every kernel costs what it
costs on the real model; attention, MLPs and the drafter all run on real data. Routed experts
may be packed INT4 (`int4_group`, as Kimi K2.6 ships them): random nibbles, scales giving the
dequantized weights the std of the float rule.

One rank's share of a TP / EP layout (`rank_share`, `random_rank`, `rank_llm`): a group of one
process builds the rank's shard of the target and drafter and serves it as a one-process engine
that launches the rank's kernels and collectives (`distributed.init_rank_share`). Its logits are
its vocabulary slice; the layers' partial sums are not completed by the absent ranks, which the
decisive construction does not need: it reads only the token's own embedding row."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from flashtree.bench.shapes import (  # noqa: F401  (importable here)
    DRAFTERS,
    INT4_GROUPS,
    QWEN3_8B,
    SHAPES,
    TINY,
    with_layers,
)
from flashtree.distributed import destroy_tp, init_rank_share
from flashtree.distributed.tp import free_port
from flashtree.llm import LLM
from flashtree.models.config import ModelConfig
from flashtree.models.dflash import DFlashConfig, DFlashDraftModel
from flashtree.models.llama import DecoderModel
from flashtree.models.loader import model_class

_COMMON = dict(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False, rms_norm_eps=1e-6,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)
_INPUT_STD = 0.02
# Output projections (o_proj, down_proj) draw N(0, scale^2 / fan_in). The target's layers move
# its unit-variance residual by a few percent (it stays near the token's embedding); the
# drafter's overwrite theirs, so that its output is not the mask token's embedding, which is
# one row of the shared LM head and would otherwise win every slot.
_TARGET_RESIDUAL_SCALE = 0.05
_DRAFTER_RESIDUAL_SCALE = 20.0
_SHARD_BYTES = 4e9  # checkpoint shards of at most this size, as released checkpoints have
# RMS of an INT4 value, uniform over -8..7 (about 4.64): a scale of std / _INT4_RMS gives the
# dequantized weights the mean square of N(0, std^2).
_INT4_RMS = (sum(v * v for v in range(-8, 8)) / 16) ** 0.5
# (layers, block size) of each shape's drafter where the seeds' differs from random_drafter's
# defaults: Kimi K2.6's, 6 bf16 layers at the target's width (about 6.5 GB whole), blocks of 8.
DRAFTER_LAYOUT = {"kimi-k2.6": (6, 8)}


def _std(name: str, fan_in: int, residual_scale: float) -> float:
    """Output projections N(0, residual_scale^2 / fan_in), every other matrix N(0, 0.02^2)."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return residual_scale / fan_in ** 0.5
    return _INPUT_STD


def _random(name: str, shape: torch.Size, gen: torch.Generator, residual_scale: float,
            int4_group: int = 0) -> torch.Tensor:
    """The value of tensor `name`: norms (and other vectors) 1, matrices as `_std` says; on the
    generator's device, float32. Packed INT4 experts (`int4_group`): `weight_packed` random
    int32 words (every nibble a valid value), `weight_scale` [out, in / group] the constant
    giving the weight `_std`'s mean square (fan_in: the `in` it unpacks to)."""
    if name.endswith("weight_packed"):
        return torch.randint(-2**31, 2**31, shape, generator=gen, device=gen.device,
                             dtype=torch.int32)
    if name.endswith("weight_scale") and int4_group:
        std = _std(name.removesuffix("_scale"), shape[-1] * int4_group, residual_scale)
        return torch.full(shape, std / _INT4_RMS, device=gen.device)
    if len(shape) == 1:
        return torch.ones(shape, device=gen.device)
    return torch.randn(shape, generator=gen, device=gen.device) * _std(name, shape[-1],
                                                                       residual_scale)


def fill_random(module: torch.nn.Module, gen: torch.Generator, residual_scale: float = 1.0,
                skip: tuple[str, ...] = (), int4_group: int = 0) -> None:
    """Every parameter of `module` by `_random`'s rule, but those under `skip` and the INT4
    `weight_shape`s."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not name.startswith(skip) and not name.endswith("weight_shape"):  # kept as built
                p.copy_(_random(name, p.shape, gen, residual_scale, int4_group))


def _decisive_head(emb: torch.Tensor, head: torch.Tensor, gen: torch.Generator) -> None:
    """In place: unit-variance embeddings, the LM head their rows in a random order (token
    order[v] is followed by v)."""
    with torch.no_grad():
        emb.copy_(torch.randn(emb.shape, generator=gen, device=emb.device))
        order = torch.randperm(emb.shape[0], generator=gen, device=emb.device)
        head.copy_(emb[order])


def _int4_quantization(group: int) -> dict:
    """A compressed-tensors quantization_config as Kimi K2.6's: routed experts' linears INT4,
    symmetric, one scale per `group` inputs; the rest unquantized."""
    weights = dict(num_bits=4, group_size=group, symmetric=True, type="int", strategy="group")
    return dict(quant_method="compressed-tensors", format="pack-quantized",
                config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"])


def _build(make, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """`make()` on `device`, then in `dtype`. Floating tensors are made in `dtype` directly
    (the default dtype while it runs), so a large model never exists in float32 too; what
    must stay float32 (routers, rotary frequencies) says so itself."""
    old = torch.get_default_dtype()
    if dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            module = make()
    finally:
        torch.set_default_dtype(old)
    return module.to(dtype)


def random_target(shape: dict, dtype: torch.dtype, device: torch.device | str, seed: int = 1,
                  int4_group: int = 0) -> tuple[DecoderModel, ModelConfig]:
    """A decisive target of `shape` (a config dict, e.g. QWEN3_8B; Qwen3 unless it names its
    architecture), its MoE experts stacked as after a load. `int4_group`: routed experts packed
    INT4 with a scale per that many inputs, the config saying so as a loaded compressed-tensors
    checkpoint's does. Built as this process's TP rank (its shard under a group)."""
    hf = {**_COMMON, **shape}
    if int4_group:
        hf["quantization_config"] = _int4_quantization(int4_group)
    cfg = ModelConfig.from_hf(hf)
    if int4_group:
        if cfg.moe is None:
            raise ValueError("int4_group needs a shape with routed experts")
        cfg = replace(cfg, moe=replace(cfg.moe, int4_group=int4_group))
    gen = torch.Generator(device).manual_seed(seed)
    model = _build(lambda: model_class(cfg)(cfg), dtype, device)
    fill_random(model, gen, _TARGET_RESIDUAL_SCALE, skip=("embed_tokens", "lm_head"),
                int4_group=int4_group)
    emb = model.embed_tokens
    rows = emb.vocab_end - emb.vocab_start  # this rank's real ids (not the last slice's pad)
    _decisive_head(emb.weight[:rows], model.lm_head.weight[:rows], gen)
    model.weights_loaded()
    return model.eval(), cfg


def _drafter_config(target_layers: int, shape: dict, layers: int, block_size: int) -> dict:
    """The z-lab DFlash config of a drafter of `layers` Qwen3 layers of `shape` reading five
    spaced layers of a target of `target_layers` (as the Qwen3-8B drafter does)."""
    taps = sorted({round(1 + i * (target_layers - 3) / 4) for i in range(5)})
    return {**shape, **_COMMON, "num_hidden_layers": layers, "architectures": ["DFlashDraftModel"],
            "block_size": block_size, "layer_types": ["full_attention"] * layers,
            "num_target_layers": target_layers,
            "dflash_config": {"target_layer_ids": taps, "mask_token_id": shape["vocab_size"] - 1}}


def random_drafter(target_cfg: ModelConfig, shape: dict, dtype: torch.dtype,
                   device: torch.device | str, layers: int = 5, block_size: int = 16,
                   logit_std: float = 10.0, seed: int = 2) -> DFlashDraftModel:
    """A DFlash drafter for `target_cfg` with `layers` Qwen3 layers of `shape` (its entry in
    shapes.DRAFTERS). Its final norm is set so that its logits over the target's LM head
    spread with standard deviation `logit_std` (10: over a 152k vocabulary its top token then
    holds 65-75% of the mass, a confident drafter's guess)."""
    cfg = DFlashConfig.from_hf(_drafter_config(target_cfg.num_layers, shape, layers, block_size))
    gen = torch.Generator(device).manual_seed(seed)
    drafter = _build(lambda: DFlashDraftModel(cfg), dtype, device)
    fill_random(drafter, gen, _DRAFTER_RESIDUAL_SCALE)
    with torch.no_grad():  # unit-variance LM head rows: logits ~ N(0, (norm * sqrt(hidden))^2)
        drafter.norm.weight.fill_(logit_std / target_cfg.hidden_size ** 0.5)
    return drafter.eval()


def parse_layout(layout: str) -> tuple[int, int]:
    """'tp8' -> (8, 1): TP, experts sliced over all 8; 'ep8' -> (8, 8): whole experts, 1/8 of
    them per rank; 'tp8ep2' -> (8, 2) (SGLang's --tp 8 --ep 2)."""
    m = re.fullmatch(r"(tp|ep)(\d+)(?:ep(\d+))?", layout)
    if m is None or (m[1] == "ep" and m[3]):
        raise ValueError(f"layout {layout!r}: expected tpN, epN or tpNepM")
    n = int(m[2])
    return n, (n if m[1] == "ep" else int(m[3] or 1))


@contextmanager
def rank_share(layout: str, device: torch.device | str = "cpu", rank: int = 0
               ) -> Iterator[tuple[int, int]]:
    """Within: this process is rank `rank`'s share of `layout` ((tp, ep) yielded), in a real
    group of one (gloo on the CPU; NCCL on a GPU, with the one-shot all-reduce for the sizes
    where its calibration over the group of one picks it); models built inside are that
    rank's shard. Rank 0 (the default) is the one to time: its vocab slice starts at id 0, so
    whole-vocabulary logits (graph replay, sampling) name the right ids; other ranks decode
    correctly only greedy and eager."""
    tp, ep = parse_layout(layout)
    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    init_rank_share(tp, ep, backend, f"tcp://127.0.0.1:{free_port()}", rank,
                    device=device if backend == "nccl" else None)
    try:
        yield tp, ep
    finally:
        destroy_tp()


def _tensors_within(module: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Every tensor `module` and its submodules hold, by id: parameters, buffers and tensors
    kept in attributes (stacked experts, absorbed projections), in tuples, lists, dicts,
    dataclasses and this project's own objects."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(obj) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[id(obj)] = obj
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item)
        elif (hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)) and (
                dataclasses.is_dataclass(obj) or type(obj).__module__.startswith("flashtree"))):
            walk(vars(obj))  # this project's objects holding tensors (e.g. Int4Weight)

    for m in module.modules():
        for name, value in vars(m).items():
            if name != "_modules":  # submodules: module.modules() visits them
                walk(value)
    return found


def repeat_layers(model: DecoderModel, cfg: ModelConfig, layers: int) -> ModelConfig:
    """Extend `model` to `layers` decoder layers: layer i past those built is a copy of built
    MoE layer first + (i - first) % (built - first) (first: the dense ones) that shares its
    weights but writes its own KV cache layer. A step then reads the bytes and runs the
    kernels of a model that deep (the layers sharing weights lie tens of layers apart, far
    beyond L2) in the memory of the layers built. Returns the deeper config (model.cfg too)."""
    built = len(model.layers)
    sparse = list(cfg.moe.sparse_layers) if cfg.moe else [False] * built
    first = sparse.index(True) if True in sparse else built
    if not first < built <= layers:
        raise ValueError(f"repeat {built} built layers ({first} dense) to {layers}: needs "
                         "a MoE layer built and no more layers built than asked")
    for i in range(built, layers):
        j = first + (i - first) % (built - first)
        source = model.layers[j]
        sparse.append(sparse[j])
        shared = _tensors_within(source)
        layer = copy.deepcopy(source, memo=dict(shared))
        assert _tensors_within(layer).keys() <= shared.keys(), "a repeated layer copied weights"
        layer.self_attn.layer = i
        model.layers.append(layer)
    model.cfg = replace(cfg, num_layers=layers, moe=replace(cfg.moe, sparse_layers=tuple(sparse)))
    return model.cfg


def random_rank(name: str, dtype: torch.dtype, device: torch.device | str,
                layers: int | None = None, int4_group: int | None = None, seed: int = 1,
                built_layers: int | None = None, **overrides
                ) -> tuple[DecoderModel, ModelConfig, DFlashDraftModel]:
    """(target, its config, drafter) of shape `name` (shapes.SHAPES, with `overrides` and cut
    to `layers` decoder layers), built as this process's rank: one rank's share inside
    `rank_share`. Routed experts INT4 as `INT4_GROUPS` has them unless `int4_group` says; the
    drafter DRAFTERS[name] with DRAFTER_LAYOUT's layers and block size (else 5 and 16). With
    `built_layers`, only that many layers hold weights of their own (`repeat_layers`)."""
    shape = with_layers({**SHAPES[name], **overrides}, layers)
    group = INT4_GROUPS.get(name, 0) if int4_group is None else int4_group
    depth = shape["num_hidden_layers"]
    if built_layers is not None:
        shape["num_hidden_layers"] = built_layers
    target, cfg = random_target(shape, dtype, device, seed, int4_group=group)
    if built_layers is not None:
        cfg = repeat_layers(target, cfg, depth)
    draft_layers, block = DRAFTER_LAYOUT.get(name, (5, 16))
    drafter = random_drafter(cfg, DRAFTERS[name], dtype, device, layers=draft_layers,
                             block_size=block, seed=seed + 1)
    return target, cfg, drafter


def rank_llm(target: DecoderModel, cfg: ModelConfig, drafter: DFlashDraftModel | None = None,
             **options) -> LLM:
    """`LLM.from_modules` over a rank's share (`random_rank` inside `rank_share`): the engine
    of one TP rank, token ids in its vocab slice. `options`: LLM's arguments."""
    # A TP member: the engine runs on the shard this process built, no workers.
    return LLM.from_modules(target, cfg, drafter, _tp_member=True, **options)


def top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the top-1 logit minus the top-2 logit ([N, V] -> [N])."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def save_target(out: Path, shape: dict, device: str, seed: int = 1) -> Path:
    """`random_target`'s model as a bf16 Hugging Face checkpoint in `out` (kept if there):
    tensors named by transformers' class for the architecture, MoE experts one tensor per
    expert and projection as released checkpoints hold them."""
    import transformers

    cfg = {**_COMMON, **shape}
    family = cfg["architectures"][0].removesuffix("ForCausalLM")
    config = getattr(transformers, f"{family}Config")(**cfg)
    with torch.device("meta"):
        names = _per_expert(getattr(transformers, f"{family}ForCausalLM")(config).state_dict())
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    return _save(out, config, names, seed, _TARGET_RESIDUAL_SCALE, device, decisive=True)


def save_drafter(out: Path, target_layers: int, shape: dict, layers: int, block_size: int,
                 device: str, logit_std: float = 10.0, seed: int = 2) -> Path:
    """`random_drafter`'s drafter as a z-lab DFlash checkpoint (the reference `dflash`
    package's format) in `out` (kept if there)."""
    from dflash.model import DFlashDraftModel as Reference
    from transformers import Qwen3Config

    raw = _drafter_config(target_layers, shape, layers, block_size)
    config = Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    config.architectures, config.block_size = raw["architectures"], block_size
    config.num_target_layers, config.dflash_config = target_layers, raw["dflash_config"]
    with torch.device("meta"):
        names = Reference(config).state_dict()
    norm = logit_std / shape["hidden_size"] ** 0.5
    return _save(out, config, names, seed, _DRAFTER_RESIDUAL_SCALE, device, final_norm=norm)


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) split into experts.{e}.{gate,up,down}_proj.weight."""
    out = {}
    for name, p in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(p.shape[0]):
                for proj in ("gate_proj", "up_proj"):
                    out[f"{name[:-12]}{e}.{proj}.weight"] = p[e, : p.shape[1] // 2]
        elif name.endswith("experts.down_proj"):
            for e in range(p.shape[0]):
                out[f"{name[:-9]}{e}.down_proj.weight"] = p[e]
        else:
            out[name] = p
    return out


def _save(out: Path, config, tensors: dict[str, torch.Tensor], seed: int, residual_scale: float,
          device: str, decisive: bool = False, final_norm: float | None = None) -> Path:
    """Random values for `tensors` (names and shapes; meta) as bf16 safetensors shards with an
    index, and `config`, in `out`; nothing done when the index is already there."""
    from safetensors.torch import save_file

    index = out / "model.safetensors.index.json"
    if index.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)
    values = {n: _random(n, p.shape, gen, residual_scale) for n, p in tensors.items()
              if not (decisive and n.endswith(("embed_tokens.weight", "lm_head.weight")))}
    if decisive:
        emb = next(n for n in tensors if n.endswith("embed_tokens.weight"))
        values[emb] = torch.empty(tensors[emb].shape, device=device)
        head = torch.empty_like(values[emb])  # tied: unused, the embedding is the LM head
        if "lm_head.weight" in tensors:
            values["lm_head.weight"] = head
        _decisive_head(values[emb], head, gen)
    if final_norm is not None:
        values["norm.weight"].fill_(final_norm)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, v in values.items():
        t = v.to(torch.bfloat16).cpu()
        if size + t.numel() * 2 > _SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * 2
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    config.save_pretrained(out)
    index.write_text(json.dumps({"metadata": {"total_size": 2 * sum(
        t.numel() for s in shards for t in s.values())}, "weight_map": weight_map}))
    return out
