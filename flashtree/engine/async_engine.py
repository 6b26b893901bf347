"""AsyncEngine: one background thread owns the LLMEngine and steps it; asyncio callers submit
requests and read per-request streams of deltas. Aborts (a client that went away) free the
request's KV at the next step and are reported to `on_finish` like finished requests."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from flashtree.distributed.tp import TPGroupStopped
from flashtree.engine.llm_engine import LLMEngine
from flashtree.logprobs import TokenLogprobs
from flashtree.sampling import SamplingParams
from flashtree.sequence import Sequence

log = logging.getLogger("flashtree.engine")

# Seconds `shutdown` waits for the engine thread's current step: part of the stop budget that
# deploy/flashtree.service's TimeoutStopSec must cover (docs/deploy.md, "Stopping").
STOP_TIMEOUT = 5.0


@dataclass
class Delta:
    """New output of one request since its previous delta (all tokens of one verify step)."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None  # the request failed; the message says why
    cached_tokens: int = 0  # prompt tokens the prefix cache held when the request started
    # Once finished: the tokens each decode step committed (1 for a plain step).
    accept_lengths: tuple[int, ...] = ()
    logprobs: list[TokenLogprobs] | None = None  # of token_ids, when the request asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # in the first delta, if asked


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue
    seq: Sequence | None = None
    sent_tokens: int = 0
    sent_text: str = ""
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_finish=None, on_fatal=None) -> None:
        self.engine = engine
        self.on_finish = on_finish  # called in the engine thread with (request, now)
        self.on_fatal = on_fatal  # called with the message when the engine cannot go on
        self.fatal: str | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._active: dict[int, _Request] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="flashtree-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API (event loop side)
    async def generate(self, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[Delta]:
        """Stream deltas of one request. Raises ValueError (before any delta) if the request
        is invalid; cancelling the iteration aborts the request."""
        if self.fatal is not None:
            raise RuntimeError(f"the engine stopped: {self.fatal}")
        req = _Request(prompt_ids, params, asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(("add", req))
        self._wake.set()
        ended = False  # refused or finished: nothing to abort
        try:
            first = await req.deltas.get()
            if isinstance(first, Exception):
                ended = True
                raise first
            while True:
                delta = await req.deltas.get()
                yield delta
                if delta.finished:
                    ended = True
                    return
        finally:
            if not ended:  # the inbox is in order: the abort finds the request added
                self._inbox.put(("abort", req))
                self._wake.set()

    def shutdown(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the engine thread after its current step, waiting at most `timeout` seconds
        (the thread is a daemon: the process can exit without it)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            log.warning("the engine thread did not stop within %.0f s; exiting without it",
                        timeout)

    # ------------------------------------------------------------------ engine thread
    def _push(self, req: _Request, item) -> None:
        try:
            req.loop.call_soon_threadsafe(req.deltas.put_nowait, item)
        except RuntimeError:  # its event loop has closed (the server stopped): nobody reads
            pass

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, req = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and self.fatal is not None:  # nothing runs any more
                self._push(req, RuntimeError(f"the engine stopped: {self.fatal}"))
            elif kind == "add":
                try:
                    req.seq = self.engine.add_request(req.prompt_ids, req.params)
                except ValueError as e:
                    self._push(req, e)
                    continue
                self._active[req.seq.seq_id] = req
                self._push(req, "admitted")
            elif req.seq is not None and req.seq.seq_id in self._active:
                self.engine.abort(req.seq)
                del self._active[req.seq.seq_id]
                if self.on_finish is not None:
                    self.on_finish(req, time.monotonic())

    def _loop(self) -> None:
        while not self._stop:
            self._drain_inbox()
            # After a fatal stop only the inbox is answered, until shutdown.
            if self.fatal is not None or not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                changed = self.engine.step()
            except TPGroupStopped as e:  # the tensor-parallel ranks cannot run any more
                self.fatal = str(e)
                self._fail_all(self.fatal)
                if self.on_fatal is not None:
                    self.on_fatal(self.fatal)
                continue
            except Exception as e:  # noqa: BLE001 - fail the requests of this step, keep serving
                log.error("engine step failed; failing its %d requests", len(self._active),
                          exc_info=e)
                self._fail_all(f"{type(e).__name__}: {e}")
                continue
            now = time.monotonic()
            for seq in changed:
                req = self._active.get(seq.seq_id)
                if req is not None:
                    self._emit(req, now)

    def _emit(self, req: _Request, now: float) -> None:
        seq = req.seq
        assert seq is not None
        first = req.first_token is None
        if first:
            req.first_token = now
        text, delta_text = self.engine.outputs.stream_text(seq), ""
        if text.startswith(req.sent_text):  # text already sent never changes
            delta_text, req.sent_text = text[len(req.sent_text):], text
        tokens = seq.output_ids[req.sent_tokens:]
        logprobs = (None if seq.params.logprobs is None
                    else seq.logprobs[req.sent_tokens:len(seq.output_ids)])
        req.sent_tokens = len(seq.output_ids)
        self._push(req, Delta(delta_text, tokens, seq.is_finished, seq.finish_reason,
                              error=seq.error, cached_tokens=seq.num_cached_tokens,
                              accept_lengths=tuple(seq.spec_accept_lengths)
                              if seq.is_finished else (), logprobs=logprobs,
                              prompt_logprobs=seq.prompt_logprobs
                              if first and seq.params.prompt_logprobs is not None else None))
        if seq.is_finished:
            del self._active[seq.seq_id]
            if self.on_finish is not None:
                self.on_finish(req, now)

    def _fail_all(self, message: str) -> None:
        """Fail every running request (the step raised): each ends with the error, its KV is
        freed, and `on_finish` sees it with finish reason "error" (not a client's abort)."""
        now = time.monotonic()
        for req in list(self._active.values()):
            assert req.seq is not None
            self.engine.abort(req.seq)
            req.seq.finish_reason, req.seq.error = "error", message
            self._push(req, Delta("", [], True, "error", error=message))
            if self.on_finish is not None:
                self.on_finish(req, now)
        self._active.clear()
