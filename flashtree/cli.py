"""Command line: `flashtree generate` and `flashtree chat` on any supported model."""

from __future__ import annotations

import argparse
import sys


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
                   help="DDTree: most children considered per node (speed only)")


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
    gen = sub.add_parser("generate", help="complete a raw prompt and print the result")
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    _add_model_args(gen)
    _add_sampling_args(gen)
    chat = sub.add_parser("chat", help="chat with the model (streams tokens to the terminal)")
    chat.add_argument("-m", "--message", default=None,
                      help="send one message, print the streamed reply and exit")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_model_args(chat)
    _add_sampling_args(chat)
    return parser


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
    return LLM(model=args.model, draft=args.draft, spec=args.spec, block_size=args.block_size,
               tree_budget=args.tree_budget, topk_cap=args.topk_cap,
               device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
               seed=args.seed)


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "chat": cmd_chat}
    try:
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
