"""One API request's answer: its `n` choices, each an engine request of its own
(`SamplingParams.choice`: choice i is seeded seed + i), collected into one response body or
merged into one stream of server-sent events. The choices start together; the scheduler lets
the later ones wait for the first to compute the prompt's pages, then reuse them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from flashtree.engine.async_engine import AsyncEngine, Delta
from flashtree.sampling import SamplingParams
from flashtree.server.logprob_format import LogprobFormat
from flashtree.server.tool_use import ToolUse


class ChoiceFailed(RuntimeError):
    """A choice's request failed in the engine (the message says why)."""


@dataclass(frozen=True)
class Reply:
    """What the response needs to know of a request besides its choices."""

    rid: str
    created: int
    kind: str  # "chat.completion" or "text_completion"
    model: str
    prompt_tokens: int
    prefix: str  # text each choice starts with (completions' echo)
    spec_stats: bool = False  # add each choice's speculation numbers (`spec_decode`)
    logprobs: LogprobFormat | None = None  # when the request asked for log-probs
    echo_ids: list[int] | None = None  # the prompt, when echoed with its log-probs
    tools: ToolUse | None = None  # chat: tool calls are parsed out of the text
    best: int | None = None  # completions' best_of: return this many, most likely first

    def choice_logprobs(self, ids: list[int], entries: list | None,
                        prompt_entries: list | None = None, offset: int = 0
                        ) -> tuple[dict | None, int]:
        """A choice's (or a chunk's) `logprobs` object, and the text offset after it
        (completions' echo: the prompt's tokens first)."""
        if self.logprobs is None:
            return None, offset
        assert entries is not None, "a request that asked for log-probs got none"
        if self.kind == "chat.completion":
            return self.logprobs.chat(ids, entries), offset
        if self.echo_ids is not None and prompt_entries is not None:
            ids, entries = self.echo_ids + ids, prompt_entries + entries
        return self.logprobs.completion(ids, entries, offset)


async def start(engine: AsyncEngine, ids: list[int], params: SamplingParams
                ) -> tuple[list[AsyncIterator[Delta]], list[Delta]]:
    """Submit every choice and wait for each one's first delta. Raises ValueError (a bad
    request; every choice is aborted) before anything is returned."""
    streams = [engine.generate(ids, params.choice(i)) for i in range(params.n)]
    firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    failed = [f for f in firsts if isinstance(f, BaseException)]
    if failed:
        await _close(streams)
        raise failed[0]
    return streams, firsts  # type: ignore[return-value]


async def body(reply: Reply, streams: list[AsyncIterator[Delta]], firsts: list[Delta]) -> dict:
    """The whole response once every choice has finished. Raises ChoiceFailed."""
    try:
        done = await asyncio.gather(*(_collect(s, f) for s, f in zip(streams, firsts)))
    finally:
        await _close(streams)
    completion = sum(len(c.token_ids) for c in done)  # every sampled choice counts
    if reply.best is not None:
        order = sorted(range(len(done)), key=lambda i: -_cumulative_logprob(done[i]))
        done, firsts = [done[i] for i in order[:reply.best]], [firsts[i] for i in order]
    choices = []
    for i, (c, first) in enumerate(zip(done, firsts)):
        logprobs, _ = reply.choice_logprobs(c.token_ids, c.logprobs, first.prompt_logprobs)
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
            choices.append({"index": i, "text": reply.prefix + c.text,
                            "finish_reason": c.last.finish_reason, "logprobs": logprobs})
    out = {"id": reply.rid, "object": reply.kind, "created": reply.created,
           "model": reply.model, "choices": choices,
           "usage": usage(reply.prompt_tokens, completion, done[0].last.cached_tokens)}
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


def _cumulative_logprob(choice: _Choice) -> float:
    assert choice.logprobs is not None, "best_of ranks by log-probs the choices did not get"
    return sum(entry[t].logprob for entry, t in zip(choice.logprobs, choice.token_ids))


async def _collect(stream: AsyncIterator[Delta], delta: Delta) -> _Choice:
    out = _Choice("", [], None if delta.logprobs is None else [], delta)
    while True:
        if delta.error:
            raise ChoiceFailed(f"request failed: {delta.error}")
        out.text += delta.text
        out.token_ids += delta.token_ids
        if out.logprobs is not None:
            out.logprobs += delta.logprobs or []
        if delta.finished:
            out.last = delta
            return out
        delta = await anext(stream)


async def events(reply: Reply, streams: list[AsyncIterator[Delta]], firsts: list[Delta],
                 include_usage: bool):
    """Server-sent events of every choice as its deltas arrive (a verify step's tokens come
    together), then the usage if asked (and the speculation numbers, if asked), then
    [DONE]."""
    chunk_kind = "chat.completion.chunk" if reply.kind == "chat.completion" else "text_completion"

    def event(choices: list[dict], **extra) -> str:
        out = {"id": reply.rid, "object": chunk_kind, "created": reply.created,
               "model": reply.model, "choices": choices, **extra}
        return f"data: {json.dumps(out)}\n\n"

    offsets = [0] * len(streams)  # completions' text offset of each choice's next token
    for i in range(len(streams)):
        if reply.kind == "chat.completion":
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        elif reply.prefix:
            logprobs, offsets[i] = reply.choice_logprobs([], [], firsts[i].prompt_logprobs)
            yield event([{"index": i, "text": reply.prefix, "logprobs": logprobs,
                          "finish_reason": None}])
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for item in _choice_events(streams[i], firsts[i], i, reply, offsets[i],
                                             event):
                await queue.put((i, *item))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    completion, cached, running = 0, firsts[0].cached_tokens, len(tasks)
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
        yield event([], usage=usage(reply.prompt_tokens, completion, cached))
    if reply.spec_stats:
        yield event([], spec_decode=[spec_decode(i, d) for i, d in enumerate(last)])
    yield "data: [DONE]\n\n"


async def _choice_events(stream: AsyncIterator[Delta], delta: Delta, index: int, reply: Reply,
                         offset: int, event):
    """(event text, the delta) for each delta of one choice until it finishes; `offset`:
    the text offset of its first token (completions' log-probs)."""
    parser = None if reply.tools is None else reply.tools.stream_parser(f"{reply.rid}-{index}")
    while True:
        if delta.error:
            err = {"error": {"message": f"request failed: {delta.error}", "type": "server_error"}}
            yield f"data: {json.dumps(err)}\n\n", delta
            return
        reason = delta.finish_reason if delta.finished else None
        logprobs, offset = reply.choice_logprobs(delta.token_ids, delta.logprobs, None, offset)
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
        yield "".join(event([c]) for c in sent), delta
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
