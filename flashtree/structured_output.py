"""Structured output through llguidance: a request's JSON schema, any-JSON object, regex, Lark
grammar or choice list becomes a token matcher that masks the target's logits at every position
a step decides.

Chosen over xgrammar by measurement (docs/structured-output.md): no dependencies (xgrammar pulls
triton into a CPU install), unsupported schema keywords are errors instead of silently ignored,
and its masks (about 10 us a token) are small next to a decode step.

Under speculation the same masks apply at every verified node: the mask of node v is the
grammar's state after the drafts on v's path, so the target's masked decision at each node is
exactly plain decoding's, a draft the grammar rejects is never accepted, and the matcher itself
only ever advances by committed tokens. The drafter's rows are masked too (`draft_masks`), so
that its proposals stay inside the grammar."""

from __future__ import annotations

import json
import re

import torch

from flashtree.sampling import SamplingParams

# Between JSON tokens: at most one line break and an indentation, the whitespace a pretty-printer
# writes. Unbounded whitespace lets a model loop in it until max_tokens (a known failure of
# constrained decoding) and leaves a valid-looking prefix that never closes.
_JSON_OPTIONS = {"whitespace_pattern": r"(\r?\n)?[\x20\x09]{0,48}"}


def grammar_of(params: SamplingParams) -> str | None:
    """The llguidance grammar of a request's guided-decoding field, or None."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if params.guided_json is not None:
        schema = params.guided_json
        return LLMatcher.grammar_from_json_schema(
            schema if isinstance(schema, str) else json.dumps(schema), _JSON_OPTIONS)
    if params.guided_json_object:
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', _JSON_OPTIONS)
    if params.guided_regex is not None:
        return LLMatcher.grammar_from_regex(params.guided_regex)
    if params.guided_choice is not None:
        return LLMatcher.grammar_from_regex("|".join(map(re.escape, params.guided_choice)))
    if params.guided_grammar is not None:  # Lark, or GBNF (llama.cpp's) converted to it
        return LLMatcher.grammar_from_lark(any_to_lark(params.guided_grammar))
    return None


def schema_error(schema: dict) -> str | None:
    """What makes `schema` a JSON schema structured output cannot follow, or None."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), _JSON_OPTIONS)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0].strip() if is_error else None


class GrammarError(ValueError):
    """A request's grammar the library refused; `field` is the request field that gave it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field


class GrammarCompiler:
    """One per engine: the tokenizer as llguidance reads it, and grammar checks."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_token_ids))

    def matcher(self, params: SamplingParams) -> TokenMatcher:
        """A fresh matcher for a guided request. Raises GrammarError naming the field and what
        the grammar library found wrong (unsupported schema keywords, a bad regex, ...)."""
        from llguidance import LLMatcher

        field = params.guided_field
        assert field is not None, "the request asks for no structured output"
        try:
            grammar = grammar_of(params)
        except Exception as e:  # noqa: BLE001 - gbnf_to_lark reports a bad grammar this way
            raise GrammarError(field, f"is not a valid grammar: {e}") from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(field, "is invalid or uses what is not supported: "
                                      f"{messages[0].strip()}")
        return TokenMatcher(LLMatcher(self.tokenizer, grammar, log_level=0), self)


class TokenMatcher:
    """One request's grammar state, advanced by committed tokens only."""

    def __init__(self, matcher, compiler: GrammarCompiler) -> None:
        self._m, self._compiler = matcher, compiler
        self.ended = False  # an end-of-sequence token was committed: the output is complete

    def accept(self, token: int) -> None:
        assert not self.ended, "a token after the grammar ended"
        if not self._m.consume_token(token):
            raise RuntimeError(f"token {token} violates the grammar: {self._m.get_error()}")
        self.ended = token in self._compiler.eos_token_ids

    def masks(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Allowed next tokens at every node of a candidate tree [n, vocab] bool: node 0 is the
        committed state; node v the state after the drafts on its path. Nodes the grammar
        rejects (or that descend from one) are never accepted: their rows allow everything,
        so that their logits stay finite."""
        n = len(tokens)
        children: list[list[int]] = [[] for _ in range(n)]
        for v in range(1, n):
            children[parents[v]].append(v)
        rows: list[bytes | None] = [None] * n

        def visit(v: int) -> None:
            bitmask = rows[v] = self._m.compute_bitmask()
            for child in children[v]:
                token = tokens[child]
                allowed = bitmask[token >> 3] >> (token & 7) & 1  # see _unpack
                if allowed and self._m.try_consume_tokens([token]):
                    visit(child)
                    self._m.rollback(1)

        visit(0)
        everything = b"\xff" * len(rows[0])  # type: ignore[arg-type]
        return _unpack(b"".join(r if r is not None else everything for r in rows),
                       self._compiler.vocab_size, n)


    def draft_masks(self, logits: torch.Tensor) -> torch.Tensor:
        """Allowed tokens at each draft depth [L, vocab] bool for draft logits [L, vocab]: the
        grammar's state after the drafter's best allowed tokens at the depths before, so a
        chain drafted from the masked rows stays inside the grammar. Depths past a dead end
        allow everything."""
        vocab = self._compiler.vocab_size
        allowed = torch.ones(logits.shape[0], vocab, dtype=torch.bool)
        consumed = 0
        for d in range(logits.shape[0]):
            allowed[d] = _unpack(self._m.compute_bitmask(), vocab)
            best = int(logits[d].masked_fill(~allowed[d].to(logits.device), float("-inf"))
                       .argmax())
            if not self._m.try_consume_tokens([best]):
                break
            consumed += 1
        self._m.rollback(consumed)
        return allowed


def _unpack(bitmask: bytes, vocab: int, rows: int | None = None) -> torch.Tensor:
    """llguidance's bitmask (bit b of byte m: token 8m + b) -> bool [vocab] or [rows, vocab]."""
    packed = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = ((packed[:, None] >> shifts) & 1).bool()
    if rows is None:
        return bits.flatten()[:vocab]
    return bits.view(rows, -1)[:, :vocab]


def mask_by_grammar(logits: torch.Tensor,
                    trees: list[tuple[TokenMatcher | None, list[int], list[int]]]
                    ) -> torch.Tensor:
    """Logits of consecutive candidate trees (per request: its matcher or None, the trees'
    node tokens and parents; a plain step's row is a tree of its last token alone) limited,
    node by node, to what each request's grammar allows there."""
    allowed = torch.ones(logits.shape, dtype=torch.bool)
    base = 0
    for matcher, tokens, parents in trees:
        if matcher is not None:
            allowed[base : base + len(tokens)] = matcher.masks(tokens, parents)
        base += len(tokens)
    assert base == logits.shape[0], f"{base} tree nodes for {logits.shape[0]} logits rows"
    return mask_logits(logits, allowed)


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] with disallowed tokens at -inf (allowed: [n, vocab] bool)."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
