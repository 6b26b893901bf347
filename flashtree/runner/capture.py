"""Which forwards an engine captures in CUDA graphs, and at which shapes: decode (one token per
request), short prompt chunks and, with a drafter, the draft block and the verify shape, at
every batch bucket up to max_num_seqs."""

from __future__ import annotations

from dataclasses import dataclass

from flashtree.config import EngineConfig
from flashtree.graphs.runner import GraphRunner, batch_buckets
from flashtree.graphs.schema import GraphDims, GraphMode

# Largest captured forward in token rows (beyond max_num_seqs decode rows): bigger verify
# batches run eagerly, where launch overhead is small next to the work.
GRAPH_MAX_ROWS = 8192
# Prompt chunks replay graphs of these tokens per request, up to PREFILL_MAX_ROWS rows: an
# eager prefill of a short prompt costs about ten decode steps in kernel launches, and wherever
# requests finish at different steps (speculation makes them), each admission is one.
PREFILL_TOKENS = (32, 64, 128, 256)
PREFILL_MAX_ROWS = 2048

Shape = tuple[GraphMode, int, int]  # (mode, tokens per request, max token rows)


def uses_cuda_graphs(args: EngineConfig) -> bool:
    """Decode, short prompt chunks, draft and verify replay CUDA graphs on CUDA, unless
    `enforce_eager`; under tensor parallelism every rank captures the same graphs, with
    their collectives inside, and replays them in the same order."""
    return args.device.type == "cuda" and not args.enforce_eager


@dataclass(frozen=True)
class GraphPlan:
    """The graphs of one engine: the schema's sizes, the batch buckets, the target's shapes
    and, with a drafter, the draft block's."""

    dims: GraphDims
    buckets: list[int]
    target: list[Shape]
    draft: Shape | None


def plan_graphs(args: EngineConfig, scratch_slot: int) -> GraphPlan | None:
    """The graphs an engine of `args` captures (None: it runs eagerly): decode and short prompt
    chunks and, with speculation, the verify shapes (a chain, or trees of each budget + 1
    tokens) and the draft block, for batch buckets up to max_num_seqs. `scratch_slot`: a KV
    slot no request owns, for padded tokens."""
    if not uses_cuda_graphs(args):
        return None
    spec, sched = args.spec, args.scheduler
    longest = sched.max_model_len + (0 if spec is None else spec.lookahead)
    dims = GraphDims(max_pages=-(-longest // args.cache.page_size) + 1,
                     scratch_slot=scratch_slot)
    max_rows = max(GRAPH_MAX_ROWS, sched.max_num_seqs)
    target = [(GraphMode.DECODE, 1, max_rows)]
    target += [(GraphMode.PREFILL, t, PREFILL_MAX_ROWS) for t in PREFILL_TOKENS]
    draft = None
    if spec is not None:
        verify = GraphMode.VERIFY_TREE if spec.method == "ddtree" else GraphMode.VERIFY_CHAIN
        target += [(verify, budget + 1, max_rows) for budget in spec.budgets]
        draft = (GraphMode.DRAFT, spec.block_size, max_rows)
    return GraphPlan(dims, batch_buckets(sched.max_num_seqs), target, draft)


def mixes_in_graphs(graphs: GraphRunner, prompt_chunks: int, decode_tokens: int,
                    longest_chunk: int) -> bool:
    """A mixed step replays a prompt graph whose every row is padded to the longest chunk: it
    runs unless the prompt chunks alone would replay one and the mixed batch would not (run
    eagerly, a prompt step costs about ten decode steps in launches)."""
    return (graphs.bucket(GraphMode.PREFILL, prompt_chunks + decode_tokens, longest_chunk)
            is not None
            or graphs.bucket(GraphMode.PREFILL, prompt_chunks, longest_chunk) is None)
