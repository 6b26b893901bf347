"""The bandwidth floor of a step: the bytes it must read (weights, the experts its tokens
touch, the KV of its context) at the measured copy bandwidth."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from flashtree.bench.timing import median_ms
from flashtree.layers.moe import SparseMoE
from flashtree.llm import LLM


def copy_bandwidth(device: torch.device, mib: int, reps: int) -> float:
    """Bytes read + written per second by a device-to-device copy of a `mib` MiB bf16 tensor."""
    n = mib * (1 << 20) // 2
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)  # [n]
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, max(reps, 10))
    return 2 * n * 2 / (ms / 1e3)


def floor_ms(num_bytes: float, bandwidth: float) -> float:
    return num_bytes / bandwidth * 1e3


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def expert_bytes(layer: SparseMoE) -> int:
    """Weight bytes of one routed expert as the layer holds it."""
    return _bytes(p for n, p in next(iter(layer.experts.values())).named_parameters()
                  if not n.endswith("weight_shape"))


def moe_layer_bytes(layer: SparseMoE, ids: torch.Tensor) -> int:
    """Weight bytes one forward of the layer must read: the distinct routed experts its
    tokens touch (`ids`, the router's picks), the router and the shared experts."""
    rest = _bytes(p for n, p in layer.named_parameters() if not n.startswith("experts."))
    return local_experts_touched(layer, ids) * expert_bytes(layer) + rest


def local_experts_touched(layer: SparseMoE, ids: torch.Tensor) -> int:
    """How many of the layer's own experts (its rank's, under expert parallelism) `ids` pick."""
    mine = (ids >= layer.first_expert) & (ids < layer.first_expert + layer.num_local)
    return int(ids[mine].unique().numel())


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of all parameters held, tied or shared tensors once; bytes a decode step reads of
    them besides the routed experts): every layer's matrices and the LM head, but of the
    embedding table only the rows it looks up (negligible), so an untied table is left out; a
    tied one is read as the LM head."""
    total = _bytes({p.data_ptr(): p for p in model.parameters()}.values())
    # Every layer reads its matrices, those it shares with another too (`repeat_layers`); the
    # table is listed once more than it is read: as the embedding (and as a tied LM head).
    read = _bytes(p for n, p in model.named_parameters(remove_duplicate=False)
                  if ".experts." not in n)
    emb = model.embed_tokens.weight
    return total, read - emb.numel() * emb.element_size()


class ExpertsTouched:
    """While entered, counts the distinct experts of its own each MoE layer's router picks (a
    host read per layer: outside timed runs only)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self.per_expert = expert_bytes(self.layers[0]) if self.layers else 0
        self.total, self._hooks = 0, []

    def __enter__(self) -> ExpertsTouched:
        self.total = 0

        def counter(layer: SparseMoE):
            def count(_module, _inputs, output) -> None:
                self.total += local_experts_touched(layer, output[1])
            return count
        self._hooks = [m.gate.register_forward_hook(counter(m)) for m in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()


@contextmanager
def eager(llm: LLM):
    """The engine's target forwards run eagerly while entered."""
    runner = llm.engine.runner
    graphs, runner.graphs = runner.graphs, None
    try:
        yield
    finally:
        runner.graphs = graphs


def step_floor_bytes(llm: LLM, run, kv_tokens: int, drafter: bool = False) -> int:
    """Bytes one target forward `run` must read: the weights a decode step reads, the experts
    its tokens touch in every MoE layer (counted in one eager run of it) and `kv_tokens`
    tokens of KV. With `drafter`, one draft block's (`draft_floor_bytes`)."""
    if drafter:
        return draft_floor_bytes(llm, kv_tokens)
    model = llm.engine.runner.model
    touched = ExpertsTouched(model)
    if touched.layers:
        with touched, eager(llm), torch.inference_mode():
            run()
    return (weight_bytes(model)[1] + touched.total * touched.per_expert
            + kv_tokens * llm.engine.cache.bytes_per_token)


def draft_floor_bytes(llm: LLM, kv_tokens: int) -> int:
    """Bytes one draft block must read: the drafter's layers, the target's LM head that scores
    the block (the embedding rows it looks up are negligible) and `kv_tokens` tokens of the
    drafter's KV."""
    proposer = llm.engine.proposer
    head = llm.engine.runner.model.lm_head.weight
    return (_bytes(proposer.draft.parameters()) + head.numel() * head.element_size()
            + kv_tokens * proposer.cache.bytes_per_token)
