"""The user-facing `LLM` class, shaped like vLLM's."""

from __future__ import annotations

import atexit
import inspect
import math
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC

import torch

from flashtree.config import (
    SPEC_METHODS,
    SPEC_POLICIES,
    TREE_SAMPLING_MODES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpecConfig,
    parse_dtype,
)
from flashtree.distributed import get_tp_size, set_ep_size
from flashtree.distributed.tp import TPDriverEngine, TPGroup
from flashtree.engine.llm_engine import LLMEngine
from flashtree.models.config import ModelConfig
from flashtree.models.dflash import DFlashDraftModel, load_dflash_drafter
from flashtree.models.llama import DecoderModel
from flashtree.models.registry import DEFAULT_DRAFTER_DIR, load_model, resolve_model_path
from flashtree.outputs import CompletionOutput, RequestOutput
from flashtree.runner.kv_pool import GIB, check_pool_device, pool_summary
from flashtree.sampling import SamplingParams
from flashtree.sequence import Sequence
from flashtree.tokenizer import Tokenizer

Prompt = str | list[int]
Modules = tuple[DecoderModel, ModelConfig, DFlashDraftModel | None]


class LLM:
    def __init__(
        self,
        model: str = "default",
        draft: str | None = None,
        spec: str | None = None,
        block_size: int | None = None,
        tree_budget: int | None = None,
        topk_cap: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        skip_tokenizer_init: bool = False,
        seed: int = 0,
        enforce_eager: bool = False,
        overlap_decode: bool | None = None,
        tree_sampling: str = "match",
        spec_policy: str = "adaptive",
        page_size: int = 16,
        kv_cache_pages: int | None = None,
        kv_cache_memory_gib: float | None = None,
        gpu_memory_utilization: float | None = None,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 1024,
        threads: int | None = None,
        quantization: str | None = None,
        _tp_member: bool = False,  # internal: a TP worker rank building its shard
        _modules: Modules | None = None,  # internal: see from_modules
    ) -> None:
        if model == "default" and draft is None and spec != "none" and _modules is None:
            draft = str(DEFAULT_DRAFTER_DIR)
        has_drafter = draft is not None if _modules is None else _modules[2] is not None
        if spec is None:
            spec = "ddtree" if has_drafter else "none"
        if spec not in SPEC_METHODS:
            raise ValueError(f"spec={spec!r} is not supported; allowed: {list(SPEC_METHODS)}")
        if spec != "none" and not has_drafter:
            raise ValueError(f"spec={spec!r} needs a drafter: pass draft='/path/to/dflash_dir'")
        if _modules is not None and tensor_parallel_size != 1:
            raise ValueError("models built in this process run without tensor parallelism")
        if block_size is not None and (spec == "none" or block_size < 2):
            raise ValueError(
                f"block_size={block_size} needs spec='dflash' or 'ddtree' and must be >= 2"
            )
        for name, value in (("tree_budget", tree_budget), ("topk_cap", topk_cap)):
            if value is not None and (spec != "ddtree" or value < 1):
                raise ValueError(f"{name}={value} needs spec='ddtree' and must be >= 1")
        if tree_sampling not in TREE_SAMPLING_MODES:
            raise ValueError(
                f"tree_sampling={tree_sampling!r} is not supported; allowed: "
                f"{list(TREE_SAMPLING_MODES)}"
            )
        if spec_policy not in SPEC_POLICIES:
            raise ValueError(f"spec_policy={spec_policy!r} is not supported; allowed: "
                             f"{list(SPEC_POLICIES)}")
        if quantization not in (None, "int4"):
            raise ValueError(f"quantization={quantization!r} is not supported; allowed: None "
                             "(weights as float) or 'int4' (a GGUF's Q4_0/Q4_1 weights kept "
                             "4-bit on the CPU)")
        if threads is not None:
            if threads < 1:
                raise ValueError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)  # process-wide, as torch's setting is
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if expert_parallel_size < 1 or tensor_parallel_size % expert_parallel_size:
            raise ValueError(
                f"expert_parallel_size {expert_parallel_size} must be >= 1 and divide "
                f"tensor_parallel_size {tensor_parallel_size}: experts are split over the "
                "ranks of the tensor-parallel group (SGLang's --tp/--ep convention)")
        if get_tp_size() > 1 and not _tp_member:
            raise ValueError("a tensor-parallel LLM is already running in this process (layers "
                             "read one process-wide group); call its shutdown() first")
        self.spec = spec
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cache = _cache_config(page_size, kv_cache_pages, kv_cache_memory_gib,
                              gpu_memory_utilization, enable_prefix_caching)
        check_pool_device(cache, self.device)
        self._tp: TPGroup | None = None
        if tensor_parallel_size > 1 and not _tp_member:
            # Every rank builds its shard from the same arguments.
            worker_kwargs = {k: v for k, v in locals().items() if k in _INIT_ARGS}
            self._tp = TPGroup.start(tensor_parallel_size, _tp_worker_engine, worker_kwargs,
                                     self.device.type)
            if self.device.type == "cuda":
                self.device = torch.device("cuda:0")
        try:
            if _modules is None:  # read by MoE layers as they are built; modules come built
                set_ep_size(expert_parallel_size)
            self._build(
                model=model, draft=draft, modules=_modules, spec=spec, block_size=block_size,
                tree_budget=tree_budget, topk_cap=topk_cap, dtype=dtype,
                max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                skip_tokenizer_init=skip_tokenizer_init, seed=seed, tree_sampling=tree_sampling,
                spec_policy=spec_policy, cache=cache,
                max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager,
                overlap_decode=overlap_decode, quantization=quantization)
        except BaseException:
            self.shutdown()
            raise
        if self._tp is not None:
            self.engine = TPDriverEngine(self.engine, self._tp)
            atexit.register(self.shutdown)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (no-op without tensor parallelism)."""
        if self._tp is not None:
            self._tp.shutdown()

    def kv_cache_summary(self) -> str:
        """"KV cache: N tokens (M pages of P) in X GiB", which the CLI prints at start-up."""
        e = self.engine
        return pool_summary(e.pages, [e.cache] + ([e.proposer.cache] if e.proposer else []))

    @classmethod
    def from_modules(cls, model: DecoderModel, model_config: ModelConfig,
                     drafter: DFlashDraftModel | None = None, **options) -> LLM:
        """An LLM over a target (and drafter) already built in this process, e.g. random
        weights made on the device for a benchmark; token ids only (no tokenizer), one
        process. `options`: the constructor's other arguments."""
        weight = next(model.parameters())
        options = {"device": str(weight.device), "dtype": weight.dtype, **options}
        return cls(_modules=(model, model_config, drafter), skip_tokenizer_init=True, **options)

    def _build(self, *, model, draft, modules, spec, block_size, tree_budget, topk_cap, dtype,
               max_model_len, max_num_seqs, skip_tokenizer_init, seed, tree_sampling,
               spec_policy, cache, max_num_batched_tokens, enforce_eager, overlap_decode,
               quantization) -> None:
        self.dtype = parse_dtype(dtype, self.device)
        if modules is None:
            path = resolve_model_path(model)
            self.model, self.model_config = load_model(path, self.dtype, self.device)
            if quantization == "int4":
                self._pack_int4(path)
            self.drafter = (None if spec == "none"
                            else load_dflash_drafter(draft, self.dtype, self.device))
        else:
            self.model, self.model_config, self.drafter = modules
            if spec == "none":
                self.drafter = None
        spec_cfg = None
        if spec != "none":
            assert self.drafter is not None
            block_size = block_size or self.drafter.cfg.block_size
            spec_cfg = SpecConfig(spec, block_size, tree_budget or block_size - 1, topk_cap,
                                  tree_sampling, spec_policy)
        self.tokenizer = None if skip_tokenizer_init else Tokenizer.load(path)
        limit = self.model_config.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                f"{limit}"
            )
        sched = SchedulerConfig(
            max_num_seqs=max_num_seqs or 64,
            max_model_len=max_model_len or min(limit, 4096),
            max_num_batched_tokens=max_num_batched_tokens,
        )
        args = EngineConfig(self.device, self.dtype, sched, cache, spec_cfg, seed, enforce_eager,
                            overlap_decode)
        self.engine = LLMEngine(self.model, self.model_config, self.tokenizer, args, self.drafter)

    def _pack_int4(self, path) -> None:
        if (path.suffix != ".gguf" or self.device.type != "cpu" or self.dtype != torch.float32
                or get_tp_size() > 1):
            raise ValueError("quantization='int4' keeps a GGUF file's 4-bit weights packed for "
                             "the CPU: it needs a .gguf model, device='cpu', float32 and one "
                             "process (no tensor parallelism)")
        from flashtree.models.gguf import pack_gguf_int4

        if pack_gguf_int4(self.model, path) == 0:
            raise ValueError(f"quantization='int4': {path.name} has no Q4_0/Q4_1 linear weights")
        _return_freed_heap()  # the float32 weights the packed ones replaced

    # ----------------------------------------------------------------- generation
    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_list(sampling_params, len(prompt_list))
        encoded = [self._encode(p) for p in prompt_list]
        return self._run(prompt_list, encoded, params_list)

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        tok = self._require_tokenizer()
        encoded = [tok.apply_chat_template(list(c)) for c in conversations]  # type: ignore[arg-type]
        params_list = self._params_list(sampling_params, len(encoded))
        return self._run([None] * len(encoded), encoded, params_list)

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
        """Generate for one tokenized prompt, yielding text as it becomes final."""
        self._require_tokenizer()
        seq = self.engine.add_request(prompt_ids, params)
        sent = ""
        try:
            while not seq.is_finished:
                self.engine.step()
                text = self.engine.outputs.stream_text(seq)
                if len(text) > len(sent) and text.startswith(sent):
                    yield text[len(sent):]
                    sent = text
        finally:
            self.engine.abort(seq)

    # ----------------------------------------------------------------- helpers
    def _run(
        self,
        prompts: list[str | None],
        encoded: list[list[int]],
        params_list: list[SamplingParams],
    ) -> list[RequestOutput]:
        choices: list[list[Sequence]] = []  # per prompt, its n choices
        try:
            for ids, params in zip(encoded, params_list):
                choices.append([])
                for i in range(params.n):
                    choices[-1].append(self.engine.add_request(ids, params.choice(i)))
            while any(not s.is_finished for seqs in choices for s in seqs):
                self.engine.step()
        finally:
            for seqs in choices:
                for s in seqs:
                    self.engine.abort(s)
        return [
            RequestOutput(
                request_id=str(seqs[0].seq_id),
                prompt=p,
                prompt_token_ids=seqs[0].prompt_ids,
                outputs=[
                    CompletionOutput(i, s.text, list(s.output_ids), s.finish_reason,
                                     list(s.spec_accept_lengths),
                                     None if s.params.logprobs is None else list(s.logprobs))
                    for i, s in enumerate(seqs)
                ],
                finished=True,
                prompt_logprobs=(None if seqs[0].params.prompt_logprobs is None
                                 else list(seqs[0].prompt_logprobs)),
            )
            for p, seqs in zip(prompts, choices)
        ]

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self._require_tokenizer().encode(prompt)
        return list(prompt)

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this LLM was built with skip_tokenizer_init=True; pass token ids")
        return self.tokenizer

    @staticmethod
    def _params_list(
        params: SamplingParams | SequenceABC[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give 1 or {n}")
        return params


def _cache_config(page_size: int, kv_cache_pages: int | None, kv_cache_memory_gib: float | None,
                  gpu_memory_utilization: float | None, enable_prefix_caching: bool
                  ) -> CacheConfig:
    """The KV cache's config from LLM's arguments, at most one of which sizes the pool."""
    sizes = [name for name, value in (("kv_cache_pages", kv_cache_pages),
                                      ("kv_cache_memory_gib", kv_cache_memory_gib),
                                      ("gpu_memory_utilization", gpu_memory_utilization))
             if value is not None]
    if len(sizes) > 1:
        raise ValueError(f"{' and '.join(sizes)} each size the KV cache; give one")
    memory_bytes = None
    if kv_cache_memory_gib is not None:
        if not 0 < kv_cache_memory_gib < math.inf:  # NaN fails too
            raise ValueError(f"kv_cache_memory_gib must be a size in GiB > 0, got "
                             f"{kv_cache_memory_gib}")
        memory_bytes = max(1, int(kv_cache_memory_gib * GIB))
    return CacheConfig(page_size=page_size, num_pages=kv_cache_pages, memory_bytes=memory_bytes,
                       prefix_caching=enable_prefix_caching,
                       gpu_memory_utilization=gpu_memory_utilization)


_INIT_ARGS = frozenset(inspect.signature(LLM.__init__).parameters) - {"self", "_tp_member",
                                                                     "_modules"}


def _tp_worker_engine(llm_kwargs: dict) -> LLMEngine:
    """A tensor-parallel worker rank's shard of the LLM that `llm_kwargs` describe."""
    return LLM(**llm_kwargs, _tp_member=True).engine


def _as_prompt_list(prompts: Prompt | SequenceABC[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    for p in prompts:
        if not (isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p))):
            raise ValueError(
                f"each prompt must be a string or a list of token ids, got {type(p).__name__}"
            )
    return prompts  # type: ignore[return-value]


def _return_freed_heap() -> None:
    """Hand memory freed on the C heap back to the OS: glibc keeps it in its arenas, where it
    would stay resident (several times the packed weights after a float32 load)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
