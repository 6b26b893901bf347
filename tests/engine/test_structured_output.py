"""Structured output in every spec mode: outputs for seeded random JSON schemas parse and validate
(jsonschema, an independent validator), and speculative decoding returns exactly plain
decoding's constrained output (greedy and seeded) while still committing several tokens a step;
regex, choice, Lark and any-JSON constraints hold; bad grammars are refused naming the field."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from flashtree import LLM, SamplingParams

ASK = "Reply with a JSON object about a person: name, age, city, hobbies."


@pytest.fixture(scope="module")
def engines():
    return {spec: LLM(model="default", spec=spec, spec_policy="fixed", device="cpu",
                      dtype="float32", max_model_len=512)
            for spec in ("none", "dflash", "ddtree")}


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A bounded schema (every string, array and number limited) so that outputs end."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cat", "dog", "7", "yes"], 3)}
    if kind == "array":
        return {"type": "array", "items": _random_schema(rng, depth + 1),
                "maxItems": rng.randint(1, 3)}
    names = rng.sample(["name", "age", "city", "tags", "ok", "size", "pet", "id"],
                       rng.randint(1, 4))
    return {"type": "object", "properties": {n: _random_schema(rng, depth + 1) for n in names},
            "required": names[: rng.randint(1, len(names))], "additionalProperties": False}


def _chat(llm: LLM, **kw):
    params = SamplingParams(**{"max_tokens": 160, "temperature": 0, **kw})
    return llm.chat([{"role": "user", "content": ASK}], params)[0].outputs[0]


@pytest.mark.parametrize("seed", range(4))
def test_random_schemas_validate_and_speculation_equals_plain(engines, seed):
    rng = random.Random(seed)
    schema = {"type": "object", "properties": {"person": _random_schema(rng, 1),
                                               "score": _random_schema(rng, 1)},
              "required": ["person", "score"], "additionalProperties": False}
    sampled = dict(temperature=0.8, seed=seed) if seed % 2 else {}
    plain = _chat(engines["none"], guided_json=schema, **sampled)
    assert plain.finish_reason == "stop", plain.text
    jsonschema.validate(json.loads(plain.text), schema)
    for spec in ("dflash", "ddtree"):
        out = _chat(engines[spec], guided_json=json.dumps(schema), **sampled)
        assert out.token_ids == plain.token_ids, (spec, out.text, plain.text)
        assert max(out.spec_accept_lengths) > 1


@pytest.mark.parametrize("field, value, check", [
    ("guided_regex", r"[A-Z][a-z]{2,8} is \d{1,2} years old\.",
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} is \d{1,2} years old\.", t)),
    ("guided_choice", ["positive", "negative", "neutral"],
     lambda t: t in ("positive", "negative", "neutral")),
    ("guided_grammar", 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/',
     lambda t: re.fullmatch(r"The answer is [0-9]{1,3}\.", t)),
    ("guided_grammar", 'root ::= "yes" | "no"', lambda t: t in ("yes", "no")),
    ("guided_json_object", True, lambda t: isinstance(json.loads(t), dict)),
], ids=["regex", "choice", "lark", "gbnf", "json-object"])
def test_other_constraints_hold_in_every_mode(engines, field, value, check):
    outs = {spec: _chat(llm, **{field: value}) for spec, llm in engines.items()}
    assert outs["none"].finish_reason == "stop" and check(outs["none"].text), outs["none"].text
    assert outs["dflash"].token_ids == outs["none"].token_ids
    assert outs["ddtree"].token_ids == outs["none"].token_ids


def test_logprobs_under_a_grammar_equal_plain(engines):
    kw = dict(guided_json_object=True, logprobs=2, max_tokens=24)
    plain = _chat(engines["none"], **kw)
    out = _chat(engines["ddtree"], **kw)
    assert out.token_ids == plain.token_ids
    for got, want in zip(out.logprobs, plain.logprobs, strict=True):
        assert list(got) == list(want)
        for token, value in want.items():
            assert got[token].logprob == pytest.approx(value.logprob, abs=1e-4)


@pytest.mark.parametrize("kw, message", [
    (dict(guided_json={"type": "object", "not": {"required": ["a"]}}),
     r"guided_json is invalid or uses what is not supported: .*not"),
    (dict(guided_json={"type": "array", "minItems": 5, "maxItems": 2}), "guided_json"),
    (dict(guided_json='{"type": "object", bad}'), "guided_json"),
    (dict(guided_regex="[a-"), r"(?s)guided_regex is invalid.*unclosed"),
    (dict(guided_grammar="start: missing_rule"), "guided_grammar is invalid"),
])
def test_bad_grammars_are_refused_naming_the_field(engines, kw, message):
    with pytest.raises(ValueError, match=message):
        engines["ddtree"].chat([{"role": "user", "content": "hi"}], SamplingParams(**kw))
    assert _chat(engines["ddtree"], max_tokens=4).token_ids  # the engine still serves


def test_at_most_one_structured_output_field():
    with pytest.raises(ValueError, match="at most one structured-output field"):
        SamplingParams(guided_regex="a+", guided_json_object=True)
    with pytest.raises(ValueError, match="guided_choice"):
        SamplingParams(guided_choice=[])


def test_draft_masks_keep_a_chain_inside_the_grammar(engines):
    """The masked drafter rows' argmax chain is accepted token by token by a fresh matcher of
    the same grammar (an independent walk), and computing the masks leaves the state as it
    was."""
    compiler = engines["none"].engine._grammar_compiler()
    params = SamplingParams(guided_json={"type": "object", "properties": {
        "n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "s"]})
    matcher, fresh = compiler.matcher(params), compiler.matcher(params)
    logits = torch.randn(12, compiler.vocab_size, generator=torch.Generator().manual_seed(0))
    before = matcher.masks([0], [0])
    chain = logits.masked_fill(~matcher.draft_masks(logits), float("-inf")).argmax(-1)
    assert torch.equal(matcher.masks([0], [0]), before)
    for token in chain.tolist():
        fresh.accept(token)  # raises if the grammar rejects it
    wild = compiler.matcher(params)  # the unmasked chain leaves the grammar
    with pytest.raises(RuntimeError, match="violates the grammar"):
        for token in logits.argmax(-1).tolist():
            wild.accept(token)
