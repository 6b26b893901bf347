"""Structured output through the `openai` client in every spec mode: response_format json_schema
and json_object, vLLM's guided_* fields, streamed and whole; outputs validate, equal plain
decoding's and equal the library's (`LLM.chat`/`LLM.generate` with the same guided fields, no
HTTP); bad schemas and grammars are 400s naming the field, and the server then still answers as
plain decoding does."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from flashtree import LLM, SamplingParams
from tests.server.conftest import MODEL

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "rank": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2}},
    "required": ["city", "rank", "tags"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Describe a city as JSON."}]
DATE = r"\d{4}-\d{2}-\d{2}"


@pytest.fixture(scope="module")
def library(tiny_chat_model):
    """The served model through the Python API, plain decoding."""
    return LLM(model=str(tiny_chat_model[0]), spec="none", device="cpu", max_model_len=256)


def _library_chat(llm: LLM, **kw) -> str:
    return llm.chat(CHAT, SamplingParams(**{"max_tokens": 150, **kw}))[0].outputs[0].text


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=CHAT, **{"max_tokens": 150, **kw})


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=1.0, seed=3)],
                         ids=["greedy", "seeded"])
def test_json_schema_validates_and_equals_plain_in_every_mode(spec_clients, library, kw):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA,
                                                   "strict": True}}
    texts = {spec: _chat(c, response_format=fmt, **kw).choices[0]
             for spec, c in spec_clients.items()}
    assert texts["none"].finish_reason == "stop"
    jsonschema.validate(json.loads(texts["none"].message.content), SCHEMA)
    assert texts["none"].message.content == _library_chat(library, guided_json=SCHEMA, **kw)
    assert texts["dflash"].message.content == texts["none"].message.content
    assert texts["ddtree"].message.content == texts["none"].message.content


def test_json_object_and_guided_fields(spec_clients, library):
    # The tiny random model never closes its first key: a JSON object's opening, and equality
    # with the library's plain decoding.
    obj_want = _library_chat(library, temperature=0, guided_json_object=True)
    choice_want = _library_chat(library, temperature=0, guided_choice=["sunny", "rainy"])
    date_want = library.generate("Date:", SamplingParams(temperature=0, max_tokens=20,
                                                         guided_regex=DATE))[0].outputs[0].text
    assert obj_want.startswith('{"') and choice_want in ("sunny", "rainy")
    assert re.fullmatch(DATE, date_want)
    for spec, client in spec_clients.items():
        obj = _chat(client, temperature=0, response_format={"type": "json_object"})
        assert obj.choices[0].message.content == obj_want, spec
        choice = _chat(client, temperature=0,
                       extra_body={"guided_choice": ["sunny", "rainy"]}).choices[0]
        assert choice.message.content == choice_want, spec
        done = client.completions.create(model=MODEL, prompt="Date:", max_tokens=20,
                                         temperature=0, extra_body={"guided_regex": DATE})
        assert done.choices[0].text == date_want, spec


def test_streamed_json_equals_whole(spec_clients):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    whole = _chat(spec_clients["ddtree"], temperature=0, response_format=fmt)
    parts = [c.choices[0].delta.content or "" for c in _chat(
        spec_clients["ddtree"], temperature=0, response_format=fmt, stream=True) if c.choices]
    assert "".join(parts) == whole.choices[0].message.content


@pytest.mark.parametrize("kw, param, says", [
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}}}),
     "response_format", "not"),
    (dict(response_format={"type": "json_schema"}), "response_format", "json_schema"),
    (dict(extra_body={"guided_regex": "[a-"}), "guided_regex", "unclosed"),
    (dict(extra_body={"guided_grammar": "start: nothing_here"}), "guided_grammar", "unknown"),
], ids=["unsupported-keyword", "schema-missing", "bad-regex", "bad-grammar"])
def test_bad_constraints_are_400s_naming_the_field(spec_clients, kw, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(spec_clients["ddtree"], **kw)
    assert e.value.body["param"] == param and says in e.value.body["message"]
    # The server still serves, and serves plain decoding's answer.
    after = _chat(spec_clients["ddtree"], temperature=0, max_tokens=3).choices[0].message
    plain = _chat(spec_clients["none"], temperature=0, max_tokens=3).choices[0].message
    assert after.content == plain.content and after.content
