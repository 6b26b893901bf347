"""Command line: `flashtree generate | chat | serve | bench | train-drafter | plan`."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

from flashtree.bench.cli import add_bench_parser, cmd_bench


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a Hugging Face dir or a .gguf file")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="engine seed for unseeded requests")
    p.add_argument("--draft", default=None, help="DFlash drafter directory (z-lab format)")
    p.add_argument("--spec", default=None, choices=["none", "dflash", "ddtree"],
                   help="speculative mode (default: ddtree with --draft, else none)")
    p.add_argument("--block-size", type=int, default=None,
                   help="DFlash block size (default: the drafter's)")
    p.add_argument("--tree-budget", type=int, default=None,
                   help="DDTree non-root nodes per step (default: block size - 1)")
    p.add_argument("--topk-cap", type=int, default=None,
                   help="DDTree: most children considered per node (speed only; default 16)")
    _add_engine_args(p)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-policy", default="adaptive", choices=["adaptive", "fixed"],
                   help="adaptive: speculate where it measures faster than plain decoding, "
                        "per batch size; fixed: always the full block or tree")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: all cores for generate and chat; "
                        "serve: one fewer, at least 1, since torch's threads collapse when "
                        "another busy process shares their cores; docs/deploy.md)")
    p.add_argument("--kv-cache-memory-gib", type=_positive_gib, default=None, metavar="GIB",
                   help="KV cache size in GiB, on any device (default on a CPU: a quarter "
                        "of the memory available, at most 4 GiB)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="SHARE",
                   help="share of the GPU's total memory for weights, activations and the KV "
                        "cache, in (0, 1] (vLLM's; default: the KV cache takes half the "
                        "memory free after loading)")
    p.add_argument("--quantization", default=None, choices=["int4"],
                   help="int4: keep a GGUF model's Q4_0/Q4_1 weights 4-bit on the CPU (about "
                        "2x faster decoding than float32; bfloat16 activations in them)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every forward runs eagerly (debugging)")
    p.add_argument("--no-overlap-decode", dest="overlap_decode", action="store_false",
                   default=None,
                   help="read each plain decode step's tokens before launching the next "
                        "(by default, on CUDA, the next is queued first)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt from scratch instead of reusing the KV pages "
                        "of prefixes computed before")


def _bounded_float(allowed: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse type: a float for which `ok` holds (NaN fails every comparison), else
    "must be `allowed`"."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    return parse


_positive_gib = _bounded_float("a size in GiB > 0", lambda x: 0 < x < math.inf)
_fraction = _bounded_float("in (0, 1]", lambda x: 0 < x <= 1)
_seconds = _bounded_float("a number of seconds >= 0", lambda x: 0 <= x < math.inf)
_positive_seconds = _bounded_float("a number of seconds > 0", lambda x: 0 < x < math.inf)


def serve_threads(threads: int | None) -> int:
    """`serve`'s torch threads: those asked for, else one fewer than torch's default (its
    cores), at least 1: torch's threads spin at their barriers, so beside another busy
    process (a load generator, the HTTP loop) threads on every core collapse
    (benchmarks/results/2026-12-06-serve-threads-cpu.md)."""
    import torch

    return threads if threads is not None else max(1, torch.get_num_threads() - 1)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    _add_chat_parser(sub)
    _add_serve_parser(sub)
    _add_plan_parser(sub)
    add_bench_parser(sub)
    _add_train_parser(sub)
    return parser


def _add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="complete a raw prompt and print the result")
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    _add_model_args(gen)
    _add_sampling_args(gen)


def _add_chat_parser(sub) -> None:
    chat = sub.add_parser("chat", help="chat with the model (streams tokens to the terminal)")
    chat.add_argument("-m", "--message", default=None,
                      help="send one message, print the streamed reply and exit")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_model_args(chat)
    _add_sampling_args(chat)


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default="default",
                       help="'default', a Hugging Face dir or a .gguf file")
    serve.add_argument("--draft", default=None, help="DFlash drafter directory")
    serve.add_argument("--spec", default=None, choices=["none", "dflash", "ddtree"])
    serve.add_argument("--block-size", type=int, default=None)
    serve.add_argument("--tree-budget", type=int, default=None)
    serve.add_argument("--topk-cap", type=int, default=None)
    serve.add_argument("--tree-sampling", default="match", choices=["match", "rrs"])
    _add_engine_args(serve)
    _add_serve_http_args(serve)
    _add_serve_engine_args(serve)


def _add_serve_http_args(serve: argparse.ArgumentParser) -> None:
    """Where the server listens, its API key, and what it allows a request and a shutdown."""
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key-file", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/*, KEY read from this "
                            "file (no access for other users; a trailing newline is dropped); "
                            "without it FLASHTREE_API_KEY from the environment, if set")
    serve.add_argument("--api-key", default=None,
                       help="the key on the command line (shows in `ps`: prefer the above)")
    serve.add_argument("--enable-docs", action="store_true",
                       help="serve /docs, /redoc and /openapi.json (off by default; not behind "
                            "the API key)")
    serve.add_argument("--shutdown-timeout", type=_seconds, default=75.0,
                       help="seconds SIGTERM lets running requests finish; streams still "
                            "running then end with an error event (default 75: with the "
                            "engine's stop, within the shipped unit's TimeoutStopSec=90; "
                            "docs/deploy.md)")
    serve.add_argument("--served-model-name", default=None,
                       help="model name clients send (default: the model argument)")
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20,
                       help="largest request body, chunked or not (413 above it)")
    serve.add_argument("--client-timeout", type=_positive_seconds, default=30.0,
                       help="seconds a request's head, then its body, may take to arrive "
                            "(408 and the connection closed after)")
    serve.add_argument("--max-tokens-limit", type=int, default=4096,
                       help="largest max_tokens a request may ask for")


def _add_serve_engine_args(serve: argparse.ArgumentParser) -> None:
    """The served engine's device, sizes and parallelism."""
    serve.add_argument("--device", default=None)
    serve.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=None)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--tp", "--tensor-parallel-size", type=int, default=1, dest="tp",
                       help="tensor-parallel ranks (one process each; GPUs 0..N-1 on CUDA)")
    serve.add_argument("--ep", "--expert-parallel-size", type=int, default=1, dest="ep",
                       help="expert-parallel size (divides --tp): routed experts are split "
                            "over --ep groups of the TP ranks, each expert sliced over "
                            "tp/ep ranks (SGLang's convention)")


def _add_plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="parameter counts and per-GPU memory under TP/EP, from "
                                       "config.json alone (no weights read)")
    plan.add_argument("--config", required=True, help="target config.json (or its directory)")
    plan.add_argument("--draft", default=None, help="DFlash drafter config.json (or directory)")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    plan.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides --tp)")
    plan.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    plan.add_argument("--gpu-memory-gib", type=float, default=139.0,
                      help="memory of one GPU (default: an H200's ~139 GiB)")
    plan.add_argument("--usable-fraction", type=float, default=0.9,
                      help="share of GPU memory for weights + KV (the rest: activations, "
                           "workspace)")


def _add_train_parser(sub) -> None:
    train = sub.add_parser("train-drafter", help="train a DFlash drafter for a target model")
    train.add_argument("--target", default="default", help="target model (as --model)")
    train.add_argument("--out", required=True, help="output directory (z-lab DFlash format)")
    train.add_argument("--block-size", type=int, default=16)
    train.add_argument("--layers", type=int, default=4, help="draft decoder layers")
    train.add_argument("--target-layer-ids", type=int, nargs="+", default=None,
                       help="target layers whose outputs feed the drafter (default: spaced)")
    train.add_argument("--mask-token-id", type=int, default=None,
                       help="mask token (default: an unused special token of the target)")
    _add_train_data_args(train)
    _add_train_run_args(train)


def _add_train_data_args(train: argparse.ArgumentParser) -> None:
    """The distillation data: prompts, the target's responses to them, and where they are kept."""
    train.add_argument("--prompts", default=None,
                       help="text file, one prompt per line (default: built-in prompt set)")
    train.add_argument("--num-prompts", type=int, default=2000,
                       help="built-in prompts to use when --prompts is not given")
    train.add_argument("--max-new-tokens", type=int, default=256,
                       help="length of the target's regenerated responses")
    train.add_argument("--self-instruct", type=int, default=0,
                       help="also ask the target to write this many prompts itself")
    train.add_argument("--sampled-fraction", type=float, default=0.0,
                       help="share of responses sampled at temperature 1 instead of greedy")
    train.add_argument("--data", default=None,
                       help="examples file (.npz): loaded if it exists, else written after "
                            "generation so later runs can reuse it")
    train.add_argument("--val-examples", type=int, default=64,
                       help="examples held out to log validation loss and accuracy (0: none)")
    train.add_argument("--labels", default="target", choices=["target", "tokens"],
                       help="what each block slot learns: the target's next-token "
                            "distribution (soft labels) or the data token (the paper's recipe)")


def _add_train_run_args(train: argparse.ArgumentParser) -> None:
    """The training run: steps, batches, optimizer, checkpoints, device."""
    train.add_argument("--steps", type=int, default=2000)
    train.add_argument("--batch-size", type=int, default=16)
    train.add_argument("--anchors", type=int, default=32, help="blocks per sequence per step")
    train.add_argument("--lr", type=float, default=6e-4)
    train.add_argument("--save-every", type=int, default=0)
    train.add_argument("--log-every", type=int, default=50)
    train.add_argument("--init-from", default=None,
                       help="continue from a drafter saved earlier (same geometry)")
    train.add_argument("--time-budget", type=float, default=None,
                       help="seconds of training; fits the step count to it")
    train.add_argument("--max-shard-mb", type=float, default=0,
                       help="write the weights as shards of at most this many MB")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--device", default=None)
    train.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    train.add_argument("--max-num-seqs", type=int, default=128,
                       help="batch size of the data generation")
    train.add_argument("--enforce-eager", action="store_true",
                       help="generate without CUDA graphs (debugging)")


def configure_server_logging() -> None:
    """flashtree's own loggers (request failures with their tracebacks, warnings) to stderr
    at INFO, each line with its time, level and logger; uvicorn configures its own."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("flashtree")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # a handler on the root logger would print every line twice


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from flashtree import LLM
    from flashtree.engine.heap import freeze_startup_heap
    from flashtree.server.app import ServerConfig, ServerState, load_in_background, make_server
    from flashtree.server.guard import read_api_key

    try:
        api_key = read_api_key(args.api_key, args.api_key_file, os.environ)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configure_server_logging()
    cfg = ServerConfig(model_name=args.served_model_name or args.model, api_key=api_key,
                       max_request_bytes=args.max_request_bytes,
                       max_tokens_limit=args.max_tokens_limit,
                       shutdown_timeout=args.shutdown_timeout, enable_docs=args.enable_docs,
                       client_timeout=args.client_timeout)
    state = ServerState()

    def make_llm():
        llm = LLM(model=args.model, draft=args.draft, spec=args.spec,
                  block_size=args.block_size, tree_budget=args.tree_budget,
                  topk_cap=args.topk_cap, tree_sampling=args.tree_sampling,
                  spec_policy=args.spec_policy, enforce_eager=args.enforce_eager,
                  overlap_decode=args.overlap_decode,
                  enable_prefix_caching=args.prefix_caching,
                  device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, seed=args.seed,
                  threads=serve_threads(args.threads), tensor_parallel_size=args.tp,
                  expert_parallel_size=args.ep, quantization=args.quantization,
                  kv_cache_memory_gib=args.kv_cache_memory_gib,
                  gpu_memory_utilization=args.gpu_memory_utilization)
        print(f"flashtree: {llm.kv_cache_summary()}", flush=True)
        freeze_startup_heap()
        return llm

    load_in_background(state, make_llm)
    # SIGTERM: uvicorn stops accepting connections and lets running requests finish.
    server = make_server(cfg, state, args.host, args.port)
    state.stop_server = lambda: setattr(server, "should_exit", True)
    server.run()
    if state.engine is not None:
        state.engine.shutdown()
    if state.llm is not None:
        state.llm.shutdown()
    if state.fatal is not None:
        print(f"error: {state.fatal}", file=sys.stderr)
        return 1
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from flashtree import LLM
    from flashtree.train import distributed
    from flashtree.train.drafter import TrainConfig, train_drafter

    if not 0.0 <= args.sampled_fraction <= 1.0:
        raise ValueError(f"--sampled-fraction must be in [0, 1], got {args.sampled_fraction}")
    if args.val_examples < 0:
        raise ValueError(f"--val-examples must be >= 0, got {args.val_examples}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (args.data and Path(args.data).exists()):
        raise ValueError("training on several processes (torchrun) needs --data naming an "
                         "existing file: generate the data with one process first")
    device = distributed.join_from_env(args.device)
    llm = LLM(model=args.target, device=device, dtype=args.dtype,
              max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager)
    examples = _distillation_data(llm, args)
    cfg = TrainConfig(
        block_size=args.block_size, num_layers=args.layers,
        target_layer_ids=tuple(args.target_layer_ids) if args.target_layer_ids else None,
        mask_token_id=args.mask_token_id, steps=args.steps, batch_size=args.batch_size,
        anchors=args.anchors, lr=args.lr, save_every=args.save_every, seed=args.seed,
        log_every=args.log_every, init_from=args.init_from, time_budget=args.time_budget,
        max_shard_mb=args.max_shard_mb, labels=args.labels,
        val_examples=min(args.val_examples, len(examples) // 10),  # at most a tenth
    )
    train_drafter(llm, examples, args.out, cfg)
    if distributed.rank_and_world()[0] == 0:
        print(f"drafter written to {args.out}", file=sys.stderr)
    distributed.leave()
    return 0


def _distillation_data(llm, args: argparse.Namespace) -> list:
    """Training examples: loaded from --data when that file exists, else the target's own
    responses (greedy, a --sampled-fraction at temperature 1) to --prompts or the built-in set
    plus --self-instruct prompts the target writes; saved to --data when given."""
    import random
    import time
    from pathlib import Path

    from flashtree.train.drafter import (
        generate_examples,
        load_examples,
        save_examples,
        self_instruct_prompts,
    )
    from flashtree.train.prompts import self_instruct_requests, training_prompts, vocabulary_words

    if args.data and Path(args.data).exists():
        examples = load_examples(args.data)
        print(f"loaded {len(examples)} examples from {args.data}", file=sys.stderr)
        return examples
    start = time.time()
    words = vocabulary_words(llm.tokenizer) if llm.tokenizer is not None else None
    if args.prompts:
        prompts = [ln.strip() for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
    else:
        prompts = training_prompts(args.num_prompts, seed=args.seed, words=words)
    if args.self_instruct and words:
        requests = self_instruct_requests(args.self_instruct, args.seed, words)
        written = self_instruct_prompts(llm, requests, seed=args.seed)
        print(f"the target wrote {len(written)} prompts in {time.time() - start:.0f}s",
              file=sys.stderr)
        prompts += written
    prompts = list(dict.fromkeys(prompts))  # greedy responses to a repeated prompt add nothing
    rng = random.Random(args.seed)
    temps = [1.0 if rng.random() < args.sampled_fraction else 0.0 for _ in prompts]
    examples = generate_examples(llm, prompts, args.max_new_tokens, temperature=temps,
                                 seed=args.seed)
    tokens = sum(len(e.tokens) - e.response_start for e in examples)
    print(f"generated {len(examples)} responses ({tokens} tokens) in {time.time() - start:.0f}s",
          file=sys.stderr)
    if args.data:
        save_examples(args.data, examples)
    return examples


def _sampling_params(args: argparse.Namespace):
    from flashtree import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens,
        seed=args.sample_seed, stop=args.stop,
    )


def _load(args: argparse.Namespace):
    from flashtree import LLM

    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    llm = LLM(model=args.model, draft=args.draft, spec=args.spec, block_size=args.block_size,
              tree_budget=args.tree_budget, topk_cap=args.topk_cap,
              spec_policy=args.spec_policy, enforce_eager=args.enforce_eager,
              overlap_decode=args.overlap_decode,
              enable_prefix_caching=args.prefix_caching,
              device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              seed=args.seed, threads=args.threads, quantization=args.quantization,
              kv_cache_memory_gib=args.kv_cache_memory_gib,
              gpu_memory_utilization=args.gpu_memory_utilization)
    print(llm.kv_cache_summary(), file=sys.stderr, flush=True)
    return llm


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _load(args)
    for out in llm.generate(args.prompt, params):
        print(out.prompt + out.outputs[0].text)
        print(f"[{len(out.outputs[0].token_ids)} tokens, finish: {out.outputs[0].finish_reason}]",
              file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _load(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = args.message is None
    while True:
        if interactive:
            try:
                user = input("you> ")
            except EOFError:
                print()
                return 0
            if not user.strip():
                continue
        else:
            user = args.message
        messages.append({"role": "user", "content": user})
        prompt_ids = llm.tokenizer.apply_chat_template(messages)
        if interactive:
            print("assistant> ", end="", flush=True)
        reply = ""
        for delta in llm.stream(prompt_ids, params):
            reply += delta
            print(delta, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": reply})
        if not interactive:
            return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from flashtree.plan import format_plan, make_plan

    print(format_plan(make_plan(args.config, args.draft, args.tp, args.ep, args.dtype,
                                args.gpu_memory_gib, args.usable_fraction)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
                "train-drafter": cmd_train_drafter, "bench": cmd_bench, "plan": cmd_plan}
    try:
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
