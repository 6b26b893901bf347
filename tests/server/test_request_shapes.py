"""The request shapes vLLM's clients send, through the real `openai` client: a list of prompts
in one completions request (texts or token ids; prompt i's choice j is index i * n + j),
`stream_options.continuous_usage_stats`, `GET /v1/models/{id}` and the Responses API, whole
and streamed. The oracle is the server's own established path: the same prompt alone, the
same request not streamed, the same conversation through chat completions."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL

PROMPTS = ["Once upon a time", "The weather today is"]
SAMPLED = {"model": MODEL, "max_tokens": 5, "temperature": 0.8, "seed": 7, "n": 2,
           "extra_body": {"ignore_eos": True}}


def test_models_retrieve(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert (e.value.body["param"], e.value.body["code"]) == ("model", "model_not_found")


def test_a_list_of_prompts_answers_each_as_if_alone(client, served_tokenizer):
    """Seeded samples: choice j of prompt i (index i * n + j) is choice j of that prompt sent
    alone, as texts and as token ids; usage adds the prompts up."""
    alone = [client.completions.create(prompt=p, **SAMPLED) for p in PROMPTS]
    ids = [served_tokenizer(p).input_ids for p in PROMPTS]
    for prompt in (PROMPTS, ids):
        both = client.completions.create(prompt=prompt, **SAMPLED)
        assert [c.index for c in both.choices] == [0, 1, 2, 3]
        assert [c.text for c in both.choices] == [c.text for a in alone for c in a.choices]
        assert both.usage.prompt_tokens == sum(len(i) for i in ids)
        assert both.usage.completion_tokens == 4 * 5
    streamed = {}
    for chunk in client.completions.create(prompt=PROMPTS, stream=True, **SAMPLED):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == [c.text for a in alone for c in a.choices]


def test_echo_and_best_of_over_a_list_of_prompts(client):
    """Each prompt echoes its own text and keeps its own best choice."""
    kw = {"model": MODEL, "max_tokens": 3, "temperature": 0.8, "seed": 3, "echo": True,
          "best_of": 2, "extra_body": {"ignore_eos": True}}
    both = client.completions.create(prompt=PROMPTS, **kw)
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]
    assert [c.text for c in both.choices] == alone
    assert all(t.startswith(p) for t, p in zip(alone, PROMPTS))


def test_continuous_usage_stats_put_the_usage_in_every_chunk(client):
    """vLLM's continuous_usage_stats (guidellm streams with it): every chunk carries the usage
    so far, growing to the non-streamed request's; without it, only the last chunk does."""
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0,
          "messages": [{"role": "user", "content": "Tell me a story"}]}
    whole = client.chat.completions.create(**kw).usage
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        **kw))
    assert all(c.usage is not None for c in chunks)
    assert all(c.usage.prompt_tokens == whole.prompt_tokens for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0
    assert counts[-1] == whole.completion_tokens and chunks[-1].choices == []
    plain = list(client.chat.completions.create(stream=True,
                                                stream_options={"include_usage": True}, **kw))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


CONVERSATION = {"instructions": "Answer briefly.", "input": "Tell me a story"}
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Tell me a story"}]


def test_responses_create_answers_as_chat_does(client):
    """Text in and out: the answer, its usage and its status ("incomplete" when cut by
    max_output_tokens) are chat completions' for the same conversation."""
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                          temperature=0)
    response = client.responses.create(model=MODEL, max_output_tokens=6, temperature=0,
                                       **CONVERSATION)
    assert response.output_text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    length = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if length else "completed")
    as_messages = client.responses.create(
        model=MODEL, max_output_tokens=6, temperature=0, input=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]}])
    assert as_messages.output_text == response.output_text


def test_responses_stream_is_what_the_openai_client_assembles(client):
    whole = client.responses.create(model=MODEL, max_output_tokens=6, temperature=0,
                                    **CONVERSATION)
    with client.responses.stream(model=MODEL, max_output_tokens=6, temperature=0,
                                 **CONVERSATION) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text and deltas
    assert (events[0].type, events[-1].type) == ("response.created", "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_responses_refuse_what_they_cannot_honour(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4", input="Hi")
