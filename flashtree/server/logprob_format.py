"""Log-probabilities in OpenAI's response shapes: chat's `logprobs.content` entries (token,
logprob, bytes, top_logprobs) and completions' parallel lists (tokens, token_logprobs,
top_logprobs, text_offset), the echoed prompt's first token without a value."""

from __future__ import annotations

from flashtree.logprobs import TokenLogprobs
from flashtree.tokenizer import Tokenizer


class LogprobFormat:
    def __init__(self, tokenizer: Tokenizer, num_top: int) -> None:
        self.tokenizer, self.num_top = tokenizer, num_top
        self._text: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id], False)
        return text

    def chat(self, ids: list[int], entries: list[TokenLogprobs]) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for token_id, entry in zip(ids, entries, strict=True):
            top = [one(t, e.logprob) for t, e in _top(entry, self.num_top)]
            content.append({**one(token_id, entry[token_id].logprob), "top_logprobs": top})
        return {"content": content}

    def completion(self, ids: list[int], entries: list[TokenLogprobs | None], offset: int
                   ) -> tuple[dict, int]:
        """The lists for `ids` whose text starts at character `offset`; also where the next
        token's text starts. An entry None (the prompt's first token) has no values."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for token_id, entry in zip(ids, entries, strict=True):
            text = self.token(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(entry[token_id].logprob)
            out["top_logprobs"].append({self.token(t): e.logprob
                                        for t, e in _top(entry, self.num_top)})
        return out, offset


def _top(entry: TokenLogprobs, num_top: int) -> list:
    """The entry's `num_top` most likely tokens, most likely first (the chosen token is in the
    entry first whatever its rank)."""
    return sorted(entry.items(), key=lambda item: item[1].rank)[:num_top]
