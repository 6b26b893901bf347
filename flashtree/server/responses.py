"""One API request's answer: the `n` choices of each of its prompts, each an engine request of
its own (`SamplingParams.choice`: choice j is seeded seed + j), collected into one response
body or merged into one stream of server-sent events; prompt i's choice j has index i * n + j,
as OpenAI numbers them. The choices start together; the scheduler lets the later ones of a
prompt wait for the first to compute the prompt's pages, then reuse them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from flashtree.engine.async_engine import AsyncEngine, Delta
from flashtree.sampling import SamplingParams
from flashtree.server.errors import EngineFailed, error_body, report_engine_failure
from flashtree.server.logprob_format import LogprobFormat
from flashtree.server.tool_use import ToolUse


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request."""

    ids: list[int]
    prefix: str = ""  # text each of its choices starts with (completions' echo)
    echo_logprobs: bool = False  # its tokens' log-probs come first (echo with log-probs)


@dataclass(frozen=True)
class Reply:
    """What the response needs to know of a request besides its choices."""

    rid: str
    request_id: str  # the server's id of the HTTP request, which the log names
    created: int
    kind: str  # "chat.completion" or "text_completion"
    model: str
    prompts: tuple[Prompt, ...]  # choice c answers prompt c // (choices per prompt)
    spec_stats: bool = False  # add each choice's speculation numbers (`spec_decode`)
    logprobs: LogprobFormat | None = None  # when the request asked for log-probs
    tools: ToolUse | None = None  # chat: tool calls are parsed out of the text
    best: int | None = None  # completions' best_of: return this many, most likely first

    def choice_logprobs(self, prompt: Prompt, ids: list[int], entries: list | None,
                        prompt_entries: list | None = None, offset: int = 0
                        ) -> tuple[dict | None, int]:
        """A choice's (or a chunk's) `logprobs` object, and the text offset after it
        (completions' echo: the prompt's tokens first)."""
        if self.logprobs is None:
            return None, offset
        assert entries is not None, "a request that asked for log-probs got none"
        if self.kind == "chat.completion":
            return self.logprobs.chat(ids, entries), offset
        if prompt.echo_logprobs and prompt_entries is not None:
            ids, entries = prompt.ids + ids, prompt_entries + entries
        return self.logprobs.completion(ids, entries, offset)

    def prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)


async def start(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams
                ) -> tuple[list[AsyncIterator[Delta]], list[Delta]]:
    """Submit every choice of every prompt (prompt i's choice j at i * n + j) and wait for each
    one's first delta. Raises ValueError (a bad request; every choice is aborted) before
    anything is returned."""
    streams = [engine.generate(ids, params.choice(j)) for ids in prompts
               for j in range(params.n)]
    firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    failed = [f for f in firsts if isinstance(f, BaseException)]
    if failed:
        await _close(streams)
        raise failed[0]
    return streams, firsts  # type: ignore[return-value]


async def body(reply: Reply, streams: list[AsyncIterator[Delta]], firsts: list[Delta]) -> dict:
    """The whole response once every choice has finished. Raises EngineFailed."""
    try:
        done = await asyncio.gather(*(_collect(s, f) for s, f in zip(streams, firsts)))
    finally:
        await _close(streams)
    completion = sum(len(c.token_ids) for c in done)  # every sampled choice counts
    cached = _cached_tokens(reply, [c.last for c in done])
    sampled = len(done) // len(reply.prompts)
    if reply.best is not None:  # each prompt's most likely choices, in that order
        order = [p * sampled + j for p in range(len(reply.prompts))
                 for j in sorted(range(sampled), key=lambda j: -_cumulative_logprob(
                     done[p * sampled + j]))[:reply.best]]
        done, firsts = [done[c] for c in order], [firsts[c] for c in order]
    choices = []
    for i, (c, first) in enumerate(zip(done, firsts)):
        prompt = reply.prompts[i * len(reply.prompts) // len(done)]
        logprobs, _ = reply.choice_logprobs(prompt, c.token_ids, c.logprobs,
                                            first.prompt_logprobs)
        if reply.kind == "chat.completion":
            message: dict = {"role": "assistant", "content": c.text}
            reason = c.last.finish_reason
            if reply.tools is not None:
                message["content"], calls = reply.tools.parse(c.text, f"{reply.rid}-{i}")
                if calls:
                    message["tool_calls"] = [call.to_openai() for call in calls]
                    reason = "tool_calls" if reason == "stop" else reason
            choices.append({"index": i, "message": message, "logprobs": logprobs,
                            "finish_reason": reason})
        else:
            choices.append({"index": i, "text": prompt.prefix + c.text,
                            "finish_reason": c.last.finish_reason, "logprobs": logprobs})
    out = {"id": reply.rid, "object": reply.kind, "created": reply.created,
           "model": reply.model, "choices": choices,
           "usage": usage(reply.prompt_tokens(), completion, cached)}
    if reply.spec_stats:
        out["spec_decode"] = [spec_decode(i, c.last) for i, c in enumerate(done)]
    return out


def spec_decode(index: int, last: Delta) -> dict:
    """One choice's decode steps, the tokens they committed, and their mean."""
    steps, tokens = len(last.accept_lengths), sum(last.accept_lengths)
    return {"index": index, "decode_steps": steps, "decode_tokens": tokens,
            "tokens_per_step": tokens / steps if steps else 0.0}


@dataclass
class _Choice:
    """One choice's whole output."""

    text: str
    token_ids: list[int]
    logprobs: list | None
    last: Delta


def _cached_tokens(reply: Reply, deltas: list[Delta]) -> int:
    """The prompt tokens each prompt's first choice found cached (read from a delta of each
    choice, in choice order), summed over the prompts."""
    per_prompt = len(deltas) // len(reply.prompts)
    return sum(deltas[p * per_prompt].cached_tokens for p in range(len(reply.prompts)))


def _cumulative_logprob(choice: _Choice) -> float:
    assert choice.logprobs is not None, "best_of ranks by log-probs the choices did not get"
    return sum(entry[t].logprob for entry, t in zip(choice.logprobs, choice.token_ids))


async def _collect(stream: AsyncIterator[Delta], delta: Delta) -> _Choice:
    out = _Choice("", [], None if delta.logprobs is None else [], delta)
    while True:
        if delta.error:
            raise EngineFailed(delta.error)
        out.text += delta.text
        out.token_ids += delta.token_ids
        if out.logprobs is not None:
            out.logprobs += delta.logprobs or []
        if delta.finished:
            out.last = delta
            return out
        delta = await anext(stream)


async def events(reply: Reply, streams: list[AsyncIterator[Delta]], firsts: list[Delta],
                 include_usage: bool, continuous_usage: bool = False):
    """Server-sent events of every choice as its deltas arrive (a verify step's tokens come
    together), then the usage if asked (and the speculation numbers, if asked), then
    [DONE]. With `continuous_usage` (vLLM's continuous_usage_stats) every chunk also carries
    the usage of its choice so far: its prompt's tokens and the tokens it has generated."""
    chunk_kind = "chat.completion.chunk" if reply.kind == "chat.completion" else "text_completion"
    prompts = [reply.prompts[i * len(reply.prompts) // len(streams)] for i in range(len(streams))]

    def event(choices: list[dict], index: int | None = None, generated: int = 0, **extra) -> str:
        out = {"id": reply.rid, "object": chunk_kind, "created": reply.created,
               "model": reply.model, "choices": choices, **extra}
        if continuous_usage and index is not None:
            out["usage"] = usage(len(prompts[index].ids), generated, firsts[index].cached_tokens)
        return f"data: {json.dumps(out)}\n\n"

    offsets = [0] * len(streams)  # completions' text offset of each choice's next token
    for i in range(len(streams)):
        if reply.kind == "chat.completion":
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}], i)
        elif prompts[i].prefix:
            logprobs, offsets[i] = reply.choice_logprobs(prompts[i], [], [],
                                                         firsts[i].prompt_logprobs)
            yield event([{"index": i, "text": prompts[i].prefix, "logprobs": logprobs,
                          "finish_reason": None}], i)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for item in _choice_events(streams[i], firsts[i], i, reply, prompts[i],
                                             offsets[i], event):
                await queue.put((i, *item))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    completion, cached, running = 0, _cached_tokens(reply, firsts), len(tasks)
    last = list(firsts)
    try:
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
                continue
            i, text, delta = item
            completion += len(delta.token_ids)
            last[i] = delta
            if text:
                yield text
    finally:  # a client that went away aborts every choice and frees its KV
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(streams)
    if include_usage:
        yield event([], usage=usage(reply.prompt_tokens(), completion, cached))
    if reply.spec_stats:
        yield event([], spec_decode=[spec_decode(i, d) for i, d in enumerate(last)])
    yield "data: [DONE]\n\n"


async def _choice_events(stream: AsyncIterator[Delta], delta: Delta, index: int, reply: Reply,
                         prompt: Prompt, offset: int, event):
    """(event text, the delta) for each delta of one choice until it finishes; `offset`:
    the text offset of its first token (completions' log-probs)."""
    parser = None if reply.tools is None else reply.tools.stream_parser(f"{reply.rid}-{index}")
    generated = 0
    while True:
        if delta.error:
            message = report_engine_failure(reply.request_id, delta.error)
            err = error_body(500, message, code="internal_error")
            yield f"data: {json.dumps(err)}\n\n", delta
            return
        reason = delta.finish_reason if delta.finished else None
        generated += len(delta.token_ids)
        logprobs, offset = reply.choice_logprobs(prompt, delta.token_ids, delta.logprobs, None,
                                                 offset)
        if reply.kind == "chat.completion":
            changes = [{"content": delta.text}] if delta.text else []
            if parser is not None:
                changes = parser.feed(delta.text) + (parser.finish() if delta.finished else [])
                if reason == "stop" and parser.calls:
                    reason = "tool_calls"
            # The step's log-probs ride on its first chunk, the finish reason on its last.
            choices = [{"index": index, "delta": c, "logprobs": None, "finish_reason": None}
                       for c in changes or [{}]]
            choices[0]["logprobs"], choices[-1]["finish_reason"] = logprobs, reason
            sent = [c for c in choices if c["delta"] or c["logprobs"] or c["finish_reason"]]
        else:
            news = delta.text or reason or (logprobs is not None and delta.token_ids)
            sent = [{"index": index, "text": delta.text, "logprobs": logprobs,
                     "finish_reason": reason}] if news else []
        yield "".join(event([c], index, generated) for c in sent), delta
        if delta.finished:
            return
        delta = await anext(stream)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage: the prompt once, every choice's completion tokens, and the prompt tokens
    the first choice found cached."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


async def _close(streams: list[AsyncIterator[Delta]]) -> None:
    for stream in streams:
        await stream.aclose()  # type: ignore[attr-defined]
