"""`flashtree serve --tp 2 --ep 2`: a real server whose DeepSeek-V3-architecture (MLA + MoE)
chat model has its routed experts split over two gloo ranks answers the openai client with the
single-process engine's greedy text (DDTree over a random drafter)."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams
from tests.server.conftest import API_KEY, MODEL, start_server
from tests.tiny import save_reference_drafter, save_tiny_deepseek_v3


@pytest.fixture(scope="module")
def moe_chat_model(tmp_path_factory):
    from flashtree.models.registry import default_model_path
    from flashtree.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("moe_chat")
    tok = Tokenizer.load(default_model_path())
    save_tiny_deepseek_v3(path, seed=4, vocab_size=len(tok.hf), eos_token_id=tok.eos_token_id)
    tok.hf.save_pretrained(path)
    drafter = save_reference_drafter(tmp_path_factory.mktemp("moe_drafter"), path,
                                     block_size=4, target_layer_ids=[0, 1])
    return path, drafter


def test_ep2_server_answers_like_the_single_process_engine(moe_chat_model):
    from openai import OpenAI

    path, drafter = moe_chat_model
    messages = [{"role": "user", "content": "Hello there"}]
    llm = LLM(model=str(path), draft=str(drafter), device="cpu", max_model_len=256)
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    base, proc = start_server(path, drafter, extra=("--tp", "2", "--ep", "2"))
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                               temperature=0)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    assert reply.usage.completion_tokens == len(want.token_ids)
    assert reply.choices[0].message.content == want.text
