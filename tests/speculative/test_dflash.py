"""DFlash drafting and chain verification against z-lab's reference (`dflash` package) and
against plain decoding. Random weights saved by the reference itself in its own format."""

from __future__ import annotations

import json
import time

import pytest
import torch

from flashtree import LLM, SamplingParams
from tests.helpers import ran_mixed_steps, record_schedules
from tests.tiny import TINY_PROMPTS, save_reference_drafter, save_tiny_qwen3

dflash_model = pytest.importorskip("dflash.model")
# The reference times itself with CUDA events; on CPU a wall clock is enough.
dflash_model._cuda_time = time.perf_counter

VOCAB = 5  # small enough that random drafts are often right, so runs of accepted tokens occur
PROMPTS = TINY_PROMPTS
DRAFTERS = {
    "b4": dict(block_size=4),
    "b8": dict(block_size=8),
    "b16": dict(block_size=16),
    "swa": dict(block_size=8, layer_types=["sliding_attention", "full_attention"],
                sliding_window=6),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("target"), seed=5, vocab_size=VOCAB,
                           initializer_range=0.3)


@pytest.fixture(scope="module", params=list(DRAFTERS))
def drafter_dir(request, tmp_path_factory, target_dir):
    return save_reference_drafter(tmp_path_factory.mktemp(request.param), target_dir, seed=7,
                                  initializer_range=0.3, **DRAFTERS[request.param])


@pytest.fixture(scope="module")
def reference(target_dir, drafter_dir):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = dflash_model.DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32)
    return target, drafter.eval()


def _llm(target_dir, drafter_dir=None, **kw) -> LLM:
    spec = "dflash" if drafter_dir else "none"
    return LLM(model=str(target_dir), draft=drafter_dir and str(drafter_dir), spec_policy="fixed",
               spec=spec,
               device="cpu", dtype="float32", skip_tokenizer_init=True, **kw)


def test_block_logits_match_reference(target_dir, drafter_dir, reference):
    target, drafter = reference
    prompt = PROMPTS[2]
    block = drafter.block_size
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
        features = dflash_model.extract_context_feature(out.hidden_states,
                                                        drafter.target_layer_ids)
        bonus = int(out.logits[0, -1].argmax())
        ids = torch.tensor([[bonus] + [drafter.mask_token_id] * (block - 1)])
        n = len(prompt)
        hidden = drafter(target_hidden=features,
                         noise_embedding=target.get_input_embeddings()(ids),
                         position_ids=torch.arange(n + block)[None])
        expected = drafter.compute_logits(hidden[:, 1:], target.lm_head)[0]

    llm = _llm(target_dir, drafter_dir)
    engine = llm.engine
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=block + 1))
    engine.step()  # prefill: computes target KV and holds the prompt's context features
    assert seq.output_ids == [bonus]
    engine.proposer.flush()  # as a speculative step does before drafting
    engine.pages.reserve(seq.seq_id, n + block)
    got = engine.proposer.draft_logits([(seq.seq_id, n, bonus, block)])
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def test_generate_matches_reference_tokens_and_accept_lengths(target_dir, drafter_dir, reference):
    target, drafter = reference
    max_new = 40
    expected = []
    for p in PROMPTS:
        r = dflash_model.dflash_generate(drafter, target, torch.tensor([p]), max_new, None,
                                         return_stats=True)
        expected.append((r.output_ids[0, len(p):].tolist(), r.acceptance_lengths))

    llm = _llm(target_dir, drafter_dir)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_new,
                                                ignore_eos=True))
    got = [(o.outputs[0].token_ids, o.outputs[0].spec_accept_lengths) for o in outs]
    assert got == expected
    assert max(max(lengths) for _, lengths in got) >= 3, "no multi-token accepts exercised"
    assert llm.engine.pages.num_free == llm.engine.pages.num_pages


def test_dflash_equals_plain_with_stops_inside_accepted_runs(target_dir, drafter_dir):
    spec, plain = _llm(target_dir, drafter_dir), _llm(target_dir)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    spec_out = spec.generate(PROMPTS, sp)
    plain_out = plain.generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in spec_out] == [o.outputs[0].token_ids
                                                          for o in plain_out]

    # Cut points strictly inside multi-token commits: token i was committed by a step that
    # also committed token i+1.
    inside = []
    for k, o in enumerate(spec_out):
        done = 1  # the prefill's token
        for length in o.outputs[0].spec_accept_lengths:
            inside += [(k, done + j) for j in range(1, length)]
            done += length
    assert inside, "no multi-token accepts to cut"
    for k, cut in inside[:: max(1, len(inside) // 6)]:
        tokens = plain_out[k].outputs[0].token_ids
        by_length = spec.generate([PROMPTS[k]], SamplingParams(temperature=0, max_tokens=cut,
                                                               ignore_eos=True))[0].outputs[0]
        assert by_length.token_ids == tokens[:cut]
        assert by_length.finish_reason == "length"
        assert sum(by_length.spec_accept_lengths) + 1 == cut
        stop = tokens[cut - 1]
        by_stop = spec.generate([PROMPTS[k]], SamplingParams(temperature=0, max_tokens=48,
                                                             stop_token_ids=[stop]))[0].outputs[0]
        assert by_stop.token_ids == tokens[: tokens.index(stop) + 1]
        assert by_stop.finish_reason == "stop"
    assert spec.engine.pages.num_free == spec.engine.pages.num_pages


def test_dflash_equals_plain_under_preemption_and_chunked_prefill(target_dir, drafter_dir):
    prompts = [PROMPTS[i % 4] * (1 + i % 3) for i in range(12)]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in _llm(target_dir).generate(prompts, sp)]
    crowded = _llm(target_dir, drafter_dir, max_num_seqs=6, page_size=4, kv_cache_pages=40,
                   max_num_batched_tokens=8)
    schedules = record_schedules(crowded.engine)
    assert [o.outputs[0].token_ids for o in crowded.generate(prompts, sp)] == expected
    assert crowded.engine.scheduler.num_preemptions > 0
    assert ran_mixed_steps(schedules)  # admissions rode on speculating requests' steps, run plain
    assert crowded.engine.pages.num_free == crowded.engine.pages.num_pages


def _edit_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key in ("target_layer_ids", "mask_token_id"):
            cfg["dflash_config"][key] = value
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, message", [
    (dict(mask_token_id=VOCAB), "mask_token_id 5 is outside the target vocabulary"),
    (dict(target_layer_ids=[0, 4]), "beyond the target's 4 layers"),
    (dict(vocab_size=7), "vocab_size 7 does not match"),
    (dict(conv_kernel_size=4), "conv_kernel_size"),
    (dict(projector_type="domino"), "projector_type"),
    (dict(architectures=["Qwen3ForCausalLM"]), "not a DFlash drafter"),
])
def test_unfit_drafters_are_refused(target_dir, tmp_path, changes, message):
    base = save_reference_drafter(tmp_path / "base", target_dir, block_size=4)
    bad = _edit_config(base, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        _llm(target_dir, bad)


def test_drafter_of_other_width_is_refused(tmp_path):
    target = save_tiny_qwen3(tmp_path / "t", vocab_size=VOCAB)
    wide = save_tiny_qwen3(tmp_path / "wide", vocab_size=VOCAB, hidden_size=48)
    drafter = save_reference_drafter(tmp_path / "d", wide, block_size=4)
    with pytest.raises(ValueError, match="hidden_size 48 does not match the target's 32"):
        _llm(target, drafter)
