"""Tokenizer and chat template, offline: `tokenizer.json`/`tokenizer_config.json` of a Hugging
Face directory, or the vocabulary and template stored in a GGUF file. transformers renders
chat templates in a sandboxed Jinja environment and never runs checkpoint code here."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


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
        return list(self.hf.encode(text))

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
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=True)
        # The template already holds any BOS token it wants.
        return list(self.hf.encode(text, add_special_tokens=False))
