"""The static inputs of a captured forward, declared once. Each field has a symbolic shape, a
dtype, the graph modes that read it and a pad rule; static buffers, validation and the replay
copy all come from this one table, so no field can be allocated but never copied, or copied
from None deep inside a grouped copy.

Layout (the same at capture and replay): requests are packed back to back as in AttentionMetadata;
a bucket of `batch` requests with up to `tokens` tokens each holds `batch * tokens` token rows.
Rows past the real tokens and requests past the real batch are padding: padded requests own no
tokens (query_start repeats its last value) and no KV (kv_lens 0); padded tokens write their K/V
to a scratch slot that no request owns and are never scored into a real row."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from flashtree.attention.backend import AttentionMetadata


class GraphMode(enum.Enum):
    DECODE = "decode"  # plain AR decode, 1 token per request
    DRAFT = "draft"  # DFlash block [bonus, mask x (B-1)] through the drafter
    VERIFY_CHAIN = "verify_chain"  # a causal chain of drafts through the target
    VERIFY_TREE = "verify_tree"  # a DDTree through the target, with the ancestor mask
    # Prompt chunks through the target, causal; a chunk that ends its prompt scores its last
    # token (one scored row per request at most).
    PREFILL = "prefill"


class GraphInputError(ValueError):
    """A replay input that does not fit the schema; names mode, bucket and field."""


@dataclass(frozen=True)
class GraphKey:
    """What selects a captured graph: everything that changes the kernel sequence."""

    mode: GraphMode
    batch: int  # requests in the bucket
    tokens: int  # tokens per request (1, the draft block, the chain, or tree budget + 1)

    def __str__(self) -> str:
        return f"mode={self.mode.value} bucket=(batch {self.batch}, tokens {self.tokens})"


@dataclass(frozen=True)
class GraphDims:
    """Engine-wide sizes the schema's shapes and pads refer to."""

    max_pages: int  # page-table width: pages of the longest request the engine admits
    scratch_slot: int  # a KV slot no request owns, for padded tokens' K/V

    def size(self, key: GraphKey, dim: str) -> int:
        sizes = {
            "batch": key.batch,
            "batch+1": key.batch + 1,
            "tokens": key.tokens,
            "num_tokens": key.batch * key.tokens,
            # Its own name: fewer rows than num_tokens where only last tokens are scored.
            "num_scored": key.batch * (1 if key.mode is GraphMode.PREFILL else key.tokens),
            "max_pages": self.max_pages,
        }
        assert dim in sizes, f"unknown schema dimension {dim!r}; known: {sorted(sizes)}"
        return sizes[dim]


# The pad of query_start: repeat the last real value, so padded requests own no tokens.
EDGE = "edge"
# The pad of slot_mapping: GraphDims.scratch_slot.
SCRATCH = "scratch_slot"


@dataclass(frozen=True)
class Field:
    name: str
    shape: tuple[str, ...]  # GraphDims.size names
    dtype: torch.dtype
    modes: frozenset[GraphMode]
    pad: int | bool | str  # a constant, EDGE or SCRATCH


ALL = frozenset(GraphMode)
_I64 = torch.int64
SCHEMA: tuple[Field, ...] = (
    Field("input_ids", ("num_tokens",), _I64, ALL, 0),
    Field("positions", ("num_tokens",), _I64, ALL, 0),
    Field("query_start", ("batch+1",), _I64, ALL, EDGE),
    Field("kv_lens", ("batch",), _I64, ALL, 0),
    Field("slot_mapping", ("num_tokens",), _I64, ALL, SCRATCH),
    Field("page_tables", ("batch", "max_pages"), _I64, ALL, 0),
    # Ancestor-or-self visibility among a request's new tokens; padded entries are never read.
    Field("new_token_mask", ("batch", "tokens", "tokens"), torch.bool,
          frozenset({GraphMode.VERIFY_TREE}), False),
    # Rows whose logits the forward returns, packed; padded rows score token row 0.
    Field("logit_rows", ("num_scored",), _I64, ALL, 0),
)
FIELDS = {f.name: f for f in SCHEMA}

Inputs = Mapping[str, torch.Tensor | None]


def fields_for(mode: GraphMode) -> tuple[Field, ...]:
    return tuple(f for f in SCHEMA if mode in f.modes)


def allocate(key: GraphKey, dims: GraphDims, device: torch.device) -> dict[str, torch.Tensor]:
    """Static buffers of every field `key.mode` reads, filled with pad values (a valid empty
    batch: capture runs on it)."""
    static = {}
    for f in fields_for(key.mode):
        shape = tuple(dims.size(key, d) for d in f.shape)
        fill = 0 if f.pad == EDGE else dims.scratch_slot if f.pad == SCRATCH else f.pad
        static[f.name] = torch.full(shape, fill, dtype=f.dtype, device=device)
    return static


def validate(key: GraphKey, batch: int, inputs: Inputs, dims: GraphDims,
             device: torch.device) -> None:
    """Check a real batch of `batch` requests against the schema for `key` without touching
    device data: every field the mode reads is a tensor of the declared dtype, device and rank
    that fits the bucket, sizes that share a dimension agree, and no field the mode does not
    read is given (it would be silently ignored). Raises GraphInputError naming the field."""

    def fail(name: str, problem: str) -> GraphInputError:
        return GraphInputError(f"{key} (real batch {batch}) field {name!r}: {problem}")

    if not 1 <= batch <= key.batch:
        raise fail("batch", f"{batch} requests do not fit a bucket of {key.batch}")
    needed = {f.name for f in fields_for(key.mode)}
    for name, value in inputs.items():
        if name not in FIELDS:
            raise fail(name, f"not in the graph input schema; known: {sorted(FIELDS)}")
        if name not in needed and value is not None:
            raise fail(name, f"given, but {key.mode.value} graphs do not read it")
    seen: dict[str, tuple[int, str]] = {"batch": (batch, "batch"),
                                        "batch+1": (batch + 1, "batch")}
    for f in fields_for(key.mode):
        value = inputs.get(f.name)
        if value is None:
            raise fail(f.name, "missing (None)")
        if not isinstance(value, torch.Tensor):
            raise fail(f.name, f"expected a tensor, got {type(value).__name__}")
        if value.dtype != f.dtype:
            raise fail(f.name, f"dtype {value.dtype}, expected {f.dtype}")
        if value.device.type != device.type or (
            device.index is not None and value.device.index != device.index
        ):
            raise fail(f.name, f"on {value.device}, expected {device}")
        if value.dim() != len(f.shape):
            raise fail(f.name, f"shape {tuple(value.shape)}, expected rank {len(f.shape)} "
                               f"{f.shape}")
        for dim, size in zip(f.shape, value.shape):
            capacity = dims.size(key, dim)
            if size > capacity:
                raise fail(f.name, f"{dim} = {size} exceeds the bucket's {capacity} "
                                   f"(shape {tuple(value.shape)})")
            if dim in seen and seen[dim][0] != size:
                raise fail(f.name, f"{dim} = {size}, but {seen[dim][1]} has {seen[dim][0]}")
            seen.setdefault(dim, (size, f.name))


def copy_inputs(key: GraphKey, static: Mapping[str, torch.Tensor], inputs: Inputs,
                dims: GraphDims) -> None:
    """Copy every field `key.mode` reads into its static buffer in place (never rebinding) and
    re-pad the rest; run `validate` first. Device-side only: no host sync."""
    for f in fields_for(key.mode):
        dst, src = static[f.name], inputs[f.name]
        assert src is not None, f"{key} field {f.name!r}: validate() must run before the copy"
        box = tuple(slice(0, n) for n in src.shape)
        if f.pad == EDGE:
            tail = dst[src.shape[0]:]
            tail.copy_(src[-1:].expand_as(tail))
        elif src.shape != dst.shape:
            dst.fill_(dims.scratch_slot if f.pad == SCRATCH else f.pad)
        dst[box].copy_(src)


def static_metadata(key: GraphKey, static: Mapping[str, torch.Tensor], page_size: int
                    ) -> AttentionMetadata:
    """Attention metadata over the static buffers of `key` (views, never copies): the padded
    layout, read by backends that plan nothing on the host inside the forward."""
    page_tables = static["page_tables"]  # [batch, max_pages]
    return AttentionMetadata(
        query_start=static["query_start"], kv_lens=static["kv_lens"],
        slot_mapping=static["slot_mapping"], page_tables=page_tables,
        max_query_len=key.tokens, max_kv_len=page_tables.shape[1] * page_size,
        new_token_mask=static.get("new_token_mask"), padded=True,
    )
