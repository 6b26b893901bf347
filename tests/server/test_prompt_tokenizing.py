"""Prompts are tokenized off the event loop: `/health` answers within 100 ms (the issue's
bound) while a 1 MB prompt is tokenized, and a prompt whose length alone proves it too long
for the context is refused without tokenizing it. The bound it uses (a byte-level token covers
at most the bytes of the longest vocabulary entry) is checked against real tokenizations."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx
import pytest

from flashtree.tokenizer import Tokenizer
from tests.server.conftest import API_KEY, MODEL, start_server, stop_servers
from tests.tiny import save_tiny_llama

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTEXT = 16384  # long enough that a 1 MB prompt's length alone does not refuse it


@pytest.fixture(scope="module")
def default_tokenizer():
    from flashtree.models.registry import default_model_path

    return Tokenizer.load(default_model_path())


@pytest.fixture(scope="module")
def long_server(tmp_path_factory, tiny_chat_model, default_tokenizer):
    """A plain-decoding server over a tiny Llama with a 16,384-token context and a 3 MB body
    limit."""
    path = tmp_path_factory.mktemp("long_context")
    save_tiny_llama(path, seed=3, vocab_size=len(default_tokenizer.hf),
                    max_position_embeddings=CONTEXT, eos_token_id=default_tokenizer.eos_token_id)
    default_tokenizer.hf.save_pretrained(path)
    base, proc = start_server(path, tiny_chat_model[1], extra=(
        "--spec", "none", "--max-model-len", str(CONTEXT), "--max-request-bytes", "3000000"))
    yield base
    stop_servers([proc])


def _complete(base: str, prompt: str) -> dict:
    r = httpx.post(f"{base}/v1/completions", headers=AUTH, timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400, r.text
    return r.json()["error"]


async def _health_waits(base: str, prompt: str) -> tuple[list[float], dict]:
    """The /health round trips of probes started every 20 ms while `prompt` is sent, each
    without waiting for the last (a loop stalled for a while holds every probe started meanwhile,
    the first for all of it), and the error the prompt gets."""
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        async def probe() -> float:
            start = time.perf_counter()
            assert (await client.get("/health")).status_code == 200
            return time.perf_counter() - start

        await probe()  # a connection is open before the prompt is sent
        sender = asyncio.create_task(client.post(
            "/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": prompt,
                                                   "max_tokens": 1}))
        probes = []
        while not sender.done():
            probes.append(asyncio.create_task(probe()))
            await asyncio.sleep(0.02)
        response = await sender
        waits = await asyncio.gather(*probes)
    assert response.status_code == 400, response.text
    return waits, response.json()["error"]


def test_health_answers_while_a_long_prompt_is_tokenized(long_server, default_tokenizer):
    """The issue's bound on the median probe: tokenizing on the loop stalls it for the whole
    tokenization, holding most probes far past 100 ms, where a probe another busy process on
    the machine delays now and then moves the median little."""
    prompt = "word " * 200_000  # 1 MB: tokenized whole, then refused as too long
    waits, error = asyncio.run(_health_waits(long_server, prompt))
    # The answer counts every token: the prompt was tokenized while the probes ran.
    assert f"has {len(default_tokenizer.encode(prompt))} tokens" in error["message"], error
    assert len(waits) >= 10, waits  # probes over a fifth of a second at least
    median = statistics.median(waits)
    assert median < 0.1, f"/health took {median:.3f} s (median of {len(waits)})"


def test_a_prompt_too_long_by_its_length_alone_is_not_tokenized(long_server,
                                                               default_tokenizer):
    prompt = "word " * 300_000  # 1.5 MB: its bytes alone prove it over 16,384 tokens
    error = _complete(long_server, prompt)
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded"), error
    bound = default_tokenizer.min_tokens(prompt)
    assert CONTEXT <= bound <= len(default_tokenizer.encode(prompt))
    assert f"has at least {bound} tokens" in error["message"], error


def _texts(tok: Tokenizer, rng: random.Random) -> list[str]:
    """Texts that pack many characters into few tokens: the longest vocabulary entries (as
    text), runs of spaces and newlines, special tokens, digits, CJK and emoji."""
    vocab = sorted(tok.hf.get_vocab().items(), key=lambda kv: -len(kv[0]))
    longest = [tok.hf.decode([i]) for _, i in vocab[:50]]
    specials = list(tok.hf.get_added_vocab())
    pieces = longest + specials + [" " * 80, "\n" * 40, "\t", "1234567890", "漢字かな",
                                   "🙂👍", "é", "\u0301", "\x00"]
    return [longest[0] * 20] + ["".join(rng.choices(pieces, k=rng.randint(1, 60)))
                                for _ in range(200)]


def test_min_tokens_never_exceeds_the_real_count(default_tokenizer):
    """The early refusal is sound: over texts built to be dense in characters per token, the
    bound is at most the real count (brute force), and tight for the longest entry repeated."""
    rng = random.Random(0)
    for text in _texts(default_tokenizer, rng):
        assert default_tokenizer.min_tokens(text) <= len(default_tokenizer.encode(text)), text
    dense = default_tokenizer.hf.decode([max(default_tokenizer.hf.get_vocab().items(),
                                             key=lambda kv: len(kv[0]))[1]]) * 20
    assert default_tokenizer.min_tokens(dense) == 20 == len(default_tokenizer.encode(dense))


def test_min_tokens_counts_only_what_the_tokenizer_keeps():
    """Where text can vanish the bound allows for it: a whitespace pre-tokenizer drops the
    spaces (no bound at all), a byte-level BPE drops the bytes its vocabulary lacks (they are
    not counted), an added token that strips its neighbours covers any run of spaces (no
    bound)."""
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    def tokenizer(vocab: list[str], pre_tokenizer) -> RustTokenizer:
        rust = RustTokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, []))
        rust.pre_tokenizer = pre_tokenizer
        return rust

    def bound_and_count(rust: RustTokenizer, text: str) -> tuple[int, int]:
        tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust))
        return tok.min_tokens(text), len(tok.encode(text))

    text = "a" + " " * 1000 + "b"
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert bound_and_count(tokenizer(["a", "b"], pre_tokenizers.Whitespace()), text) == (0, 2)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    partial = tokenizer([c for c in alphabet if c != "b"], byte_level)
    assert bound_and_count(partial, text) == (len(text) - 1, len(text) - 1)
    complete = tokenizer(alphabet, byte_level)
    assert bound_and_count(complete, text) == (len(text), len(text))
    complete.add_special_tokens([AddedToken("<x>", rstrip=True)])
    assert bound_and_count(complete, "<x>" + text[1:]) == (0, 2)


def test_bytes_outside_the_default_vocabulary_are_not_counted(default_tokenizer):
    """SmolLM2's vocabulary lacks a few control bytes: a megabyte of them is no token."""
    text = "\x04" * 100_000 + "hi"
    assert len(default_tokenizer.encode(text)) == 1
    assert default_tokenizer.min_tokens(text) == 1


def test_a_lone_surrogate_is_a_value_error(default_tokenizer):
    """The library's encode names the character, where the tokenizer raised a TypeError."""
    with pytest.raises(ValueError, match=r"character 1 is a lone surrogate \(U\+D800\)"):
        default_tokenizer.encode("a\ud800b")
