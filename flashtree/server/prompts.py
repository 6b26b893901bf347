"""A request's prompts as token ids, made off the event loop (while a long text is tokenized or
a conversation rendered, the loop would answer nothing else) and refused as soon as they cannot
fit the context: a text whose length alone proves it too long is never tokenized or rendered."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from flashtree.server.errors import ApiError
from flashtree.server.protocol import ChatMessage
from flashtree.server.tool_use import ToolUse, render_prompt
from flashtree.tokenizer import Tokenizer

T = TypeVar("T")


class PromptBuilder:
    """Tokenizes on one worker thread, as vLLM does: a Hugging Face tokenizer used from several
    threads at once can fail ("Already borrowed"), and one thread keeps the loop free."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="flashtree-tokenizer")

    async def run(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on the tokenizer's thread (tokenizers release the GIL while they work)."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def completion(self, prompts: list[str | list[int]], max_tokens: int | None,
                         limit_field: str) -> list[list[int]]:
        """Each prompt's ids (a text tokenized, a token list checked against the vocabulary).
        Raises ApiError naming `prompt` (or `prompt.i` in a list) or `limit_field`."""
        out = []
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            if isinstance(prompt, str):
                ids = await self.run(self._tokenize, prompt, max_tokens, param, limit_field)
            else:
                ids = list(prompt)
                outside = [t for t in ids if not 0 <= t < self.vocab_size]
                if outside:
                    raise ApiError(400, f"prompt token ids {outside[:5]} are outside the "
                                        f"vocabulary [0, {self.vocab_size})", param)
            self.check_length(len(ids), max_tokens, param, limit_field)
            out.append(ids)
        return out

    def _tokenize(self, text: str, max_tokens: int | None, param: str, limit_field: str
                  ) -> list[int]:
        """On the worker: refuse a text whose length alone proves it too long, else tokenize."""
        self.check_length(self.tokenizer.min_tokens(text), max_tokens, param, limit_field,
                          at_least=True)
        return self.tokenizer.encode(text)

    async def chat(self, messages: list[ChatMessage], tools: ToolUse | None,
                   max_tokens: int | None, param: str, limit_field: str) -> list[int]:
        """A conversation's prompt ids, through the chat template. Raises ApiError naming
        `param` (the field holding the conversation) or `limit_field`."""
        return await self.run(self._render, messages, tools, max_tokens, param, limit_field)

    def _render(self, messages: list[ChatMessage], tools: ToolUse | None,
                max_tokens: int | None, param: str, limit_field: str) -> list[int]:
        """On the worker: refuse a conversation whose user messages alone are too long (every
        template renders them whole, less surrounding whitespace; assistant, system and tool
        turns may be dropped or cut), else render it and check the prompt's length."""
        users = "".join(m.content.strip() for m in messages if m.role == "user" and m.content)
        self.check_length(self.tokenizer.min_tokens(users), max_tokens, param, limit_field,
                          at_least=True)
        ids = render_prompt(messages, self.tokenizer, tools, param)
        self.check_length(len(ids), max_tokens, param, limit_field)
        return ids

    def check_length(self, prompt_tokens: int, max_tokens: int | None, param: str,
                     limit_field: str, at_least: bool = False) -> None:
        """Refuse a prompt of `prompt_tokens` (a lower bound when `at_least`) that leaves no room
        in the context, or no room for the `max_tokens` the client asked for (vLLM's 400: the
        server does not quietly shorten the completion). `param` names the prompt's field:
        "prompt" (or "prompt.i"), "messages" or "input"."""
        window, count = self.max_model_len, f"{'at least ' if at_least else ''}{prompt_tokens}"
        what = param.split(".")[0]
        subject = "the messages have" if what == "messages" else f"the {what} has"
        if prompt_tokens >= window:
            raise ApiError(400, f"{subject} {count} tokens; this model's context "
                                f"(max_model_len) is {window} tokens, so a prompt may have at "
                                f"most {window - 1}", param, "context_length_exceeded")
        if max_tokens is not None and prompt_tokens + max_tokens > window:
            raise ApiError(400, f"This model's maximum context length (max_model_len) is "
                                f"{window} tokens. However, you requested "
                                f"{'at least ' if at_least else ''}{prompt_tokens + max_tokens} "
                                f"tokens ({count} in the {what}, {max_tokens} in the "
                                f"completion). Please reduce the length of the {what} or "
                                f"{limit_field}.", limit_field, "context_length_exceeded")

    def check_plain_text(self, texts: list[str] | None, param: str) -> None:
        """Text a grammar must write (guided_choice) holds no special token's text: llguidance
        forces such text as the special token and then refuses that token (the request would
        fail mid-answer), and an answer's text drops special tokens anyway."""
        special = {t.content for t in self.tokenizer.hf.added_tokens_decoder.values()
                   if t.special}
        for i, text in enumerate(texts or []):
            found = [s for s in special if s in text]
            if found:
                raise ApiError(400, f"{param} {i} holds the special token {found[0]!r}, which "
                                    "structured output cannot write as text", f"{param}.{i}")

    def check_token_ids(self, ids: list[int] | None, param: str) -> None:
        """Token ids a request names (stop_token_ids) must be in the vocabulary; the error
        names the first one outside it as `param.i`, as the request's validation names a
        negative one."""
        outside = [i for i, t in enumerate(ids or []) if not 0 <= t < self.vocab_size]
        if outside:
            bad = [ids[i] for i in outside[:5]]  # type: ignore[index]
            raise ApiError(400, f"{param} {bad} are outside the vocabulary "
                                f"[0, {self.vocab_size})", f"{param}.{outside[0]}")
