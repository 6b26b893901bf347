"""Tokenizer and chat template, offline: `tokenizer.json`/`tokenizer_config.json` of a Hugging
Face directory, or the vocabulary and template stored in a GGUF file. transformers renders
chat templates in a sandboxed Jinja environment and never runs checkpoint code here."""

from __future__ import annotations

import json
import math
import os
import shutil
from functools import cached_property
from pathlib import Path

# Pre-tokenizers that split text without dropping any of it (a "Removed" split behaviour drops
# the matches, Whitespace drops the spaces).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation", "Sequence"}


def unicode_error(text: str) -> str | None:
    """Why `text` is not Unicode text that can be tokenized, or None: a lone surrogate, which
    JSON's "\\ud800" escape can carry and UTF-8 cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"character {e.start} is a lone surrogate (U+{ord(text[e.start]):04X}), which is "
                "not Unicode text; send each surrogate pair whole")
    return None


def _components(pre_tokenizer: dict | None) -> list[dict]:
    """A pre-tokenizer and, for a Sequence, each of its members (recursively)."""
    if pre_tokenizer is None:
        return []
    members = pre_tokenizer.get("pretokenizers") or []
    return [pre_tokenizer] + [c for m in members for c in _components(m)]


class Tokenizer:
    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer

    @staticmethod
    def load(source: Path) -> Tokenizer:
        from transformers import AutoTokenizer

        if source.suffix == ".gguf":
            return Tokenizer._load_gguf(source)
        else:
            tok = AutoTokenizer.from_pretrained(
                str(source), local_files_only=True, trust_remote_code=False
            )
        return Tokenizer(tok)

    @staticmethod
    def _load_gguf(source: Path) -> Tokenizer:
        """Convert the GGUF vocabulary once and keep the result beside the cached weights."""
        from transformers import AutoTokenizer

        from flashtree.models.gguf import gguf_cache_dir

        cache = gguf_cache_dir(source) / "tokenizer"
        if (cache / "tokenizer_config.json").is_file():
            return Tokenizer(AutoTokenizer.from_pretrained(str(cache), local_files_only=True))
        tok = AutoTokenizer.from_pretrained(
            str(source.parent), gguf_file=source.name, local_files_only=True
        )
        tmp = cache.with_name(f"tokenizer.tmp{os.getpid()}")
        try:
            tok.save_pretrained(str(tmp))
            tmp.rename(cache)  # atomic: a half-written cache is never read
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # caching is only an optimisation
        return Tokenizer(tok)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (with the tokenizer's BOS if it adds one). Raises ValueError for
        text that is not Unicode (a lone surrogate)."""
        error = unicode_error(text)
        if error is not None:
            raise ValueError(error)
        return list(self.hf.encode(text))

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text` from its length alone (0 where there is none):
        in a byte-level BPE a token covers at most the bytes of the longest vocabulary entry,
        and every byte of the text that is in the vocabulary is covered by some token."""
        if self._byte_bound is None:
            return 0
        longest, dropped = self._byte_bound
        kept = text.encode("utf-8", "surrogatepass").translate(None, dropped)
        return math.ceil(len(kept) / longest)

    @cached_property
    def _byte_bound(self) -> tuple[int, bytes] | None:
        """(the most bytes one token covers, the bytes no token covers: BPE drops them) for a
        byte-level BPE that keeps every other byte of the text, else None."""
        from tokenizers.pre_tokenizers import ByteLevel
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return None
        spec = json.loads(backend.to_str())
        splits = _components(spec.get("pre_tokenizer"))
        model, added = spec.get("model") or {}, spec.get("added_tokens") or []
        keeps_text = (
            spec.get("normalizer") is None
            and any(s.get("type") == "ByteLevel" for s in splits)
            and all(s.get("type") in _KEEPING_PRE_TOKENIZERS and s.get("behavior") != "Removed"
                    for s in splits)
            and model.get("type") == "BPE"
            # One unknown token per missing byte is covered; a fused one covers any run.
            and not (model.get("unk_token") is not None and model.get("fuse_unk"))
            # An added token that strips the spaces beside it covers any number of them.
            and not any(t.get("lstrip") or t.get("rstrip") for t in added)
        )
        if not keeps_text:
            return None
        vocab = self.hf.get_vocab()
        specials = {t["content"] for t in added}
        longest = max([len(k) for k in vocab if k not in specials]  # a character per byte
                      + [len(t.encode()) for t in specials])
        known = set(vocab) if model.get("unk_token") is None else set(ByteLevel.alphabet())
        dropped = bytes(b for b, c in bytes_to_unicode().items() if c not in known)
        return longest, dropped

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def special_token_id(self, text: str) -> int | None:
        """The id of `text` when it is one added (special) token of this tokenizer."""
        return self.hf.get_added_vocab().get(text)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None
                            ) -> list[int]:
        """The prompt of a conversation (and the tools the template shows the model)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        # transformers' apply_chat_template drops every key whose value is None; so does this,
        # except the null content of a turn that only made calls, which DeepSeek V3's template
        # tests (`content is none`) to render the calls.
        shown = [{k: v for k, v in m.items() if v is not None or (
            k == "content" and m.get("tool_calls"))} for m in messages]
        (text,), _ = render_jinja_template(
            [shown], tools=tools, chat_template=self.hf.get_chat_template(None, tools),
            add_generation_prompt=True, **self.hf.special_tokens_map)
        error = unicode_error(text)
        if error is not None:
            raise ValueError(f"the rendered conversation's {error}")
        # The template already holds any BOS token it wants.
        return list(self.hf.encode(text, add_special_tokens=False))
