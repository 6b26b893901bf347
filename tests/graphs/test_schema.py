"""The graph input schema and runner on CPU (the runner calls the forward eagerly on its static
buffers: same allocation, validation and copy as a CUDA graph replay)."""

from __future__ import annotations

import pytest
import torch

import flashtree.graphs.runner as runner_mod
from flashtree.graphs.runner import GraphRunner
from flashtree.graphs.schema import (
    FIELDS,
    GraphInputError,
    GraphKey,
    GraphMode,
    copy_inputs,
    fields_for,
    validate,
)
from tests.graphs.inputs import DIMS, make_inputs, model_like

CPU = torch.device("cpu")
TOKENS = {GraphMode.DECODE: 1, GraphMode.DRAFT: 4, GraphMode.VERIFY_CHAIN: 4,
          GraphMode.VERIFY_TREE: 5, GraphMode.PREFILL: 6}


def _runner(poison: bool = False, buckets=(1, 2, 4)) -> GraphRunner:
    runner = GraphRunner(model_like, DIMS, CPU, buckets, poison=poison)
    for mode, tokens in TOKENS.items():
        runner.capture(mode, tokens)
    return runner


def _q_lens(mode: GraphMode, n: int, seed: int) -> list[int]:
    t = TOKENS[mode]
    if mode in (GraphMode.DECODE, GraphMode.DRAFT):
        return [t] * n
    return [1 + (seed * 7 + i * 3) % t for i in range(n)]  # ragged chains and trees


def _error(mode: GraphMode, batch: int, inputs, key_batch: int = 4) -> str:
    key = GraphKey(mode, key_batch, TOKENS[mode])
    with pytest.raises(GraphInputError) as info:
        validate(key, batch, inputs, DIMS, CPU)
    return str(info.value)


def test_missing_field_is_named_with_mode_and_bucket():
    inputs = make_inputs(GraphMode.VERIFY_TREE, [5, 3, 2], "cpu")
    inputs["new_token_mask"] = None
    msg = _error(GraphMode.VERIFY_TREE, 3, inputs)
    assert "mode=verify_tree" in msg and "batch 4, tokens 5" in msg
    assert "'new_token_mask'" in msg and "missing" in msg
    del inputs["new_token_mask"]
    assert "'new_token_mask'" in _error(GraphMode.VERIFY_TREE, 3, inputs)


def test_replay_with_a_field_removed_raises_the_named_error():
    runner = _runner()
    inputs = make_inputs(GraphMode.DECODE, [1, 1, 1], "cpu")
    del inputs["positions"]
    with pytest.raises(GraphInputError, match=r"mode=decode bucket=\(batch 4, tokens 1\).*"
                                              r"'positions': missing"):
        runner.run(GraphMode.DECODE, 3, 1, inputs)


def test_wrong_dtype_is_named():
    inputs = make_inputs(GraphMode.VERIFY_CHAIN, [4, 4], "cpu")
    inputs["positions"] = inputs["positions"].int()
    msg = _error(GraphMode.VERIFY_CHAIN, 2, inputs)
    assert "mode=verify_chain" in msg and "'positions'" in msg and "torch.int32" in msg


def test_oversize_batch_is_named():
    inputs = make_inputs(GraphMode.DECODE, [1] * 5, "cpu")
    msg = _error(GraphMode.DECODE, 5, inputs)
    assert "mode=decode" in msg and "batch 4" in msg and "'batch'" in msg
    with pytest.raises(GraphInputError, match=r"mode=decode .*no captured bucket"):
        _runner().run(GraphMode.DECODE, 5, 1, inputs)


@pytest.mark.parametrize("problem", ["rank", "too_wide", "batch_mismatch", "unread", "unknown",
                                     "not_tensor", "tokens_mismatch"])
def test_other_mismatches_are_named(problem):
    mode = GraphMode.VERIFY_TREE if problem == "tokens_mismatch" else GraphMode.DECODE
    inputs = make_inputs(mode, [3, 2, 1] if mode == GraphMode.VERIFY_TREE else [1, 1, 1], "cpu")
    field = {
        "rank": "slot_mapping", "too_wide": "page_tables", "batch_mismatch": "kv_lens",
        "unread": "new_token_mask", "unknown": "hidden", "not_tensor": "input_ids",
        "tokens_mismatch": "new_token_mask",
    }[problem]
    if problem == "rank":
        inputs[field] = inputs[field][:, None]
    elif problem == "too_wide":
        inputs[field] = torch.zeros(3, DIMS.max_pages + 1, dtype=torch.long)
    elif problem == "batch_mismatch":
        inputs[field] = inputs[field][:2]
    elif problem in ("unread", "unknown"):
        inputs[field] = torch.zeros(3, 1, 1, dtype=torch.bool)
    elif problem == "not_tensor":
        inputs[field] = [0, 1, 2]
    else:
        inputs[field] = inputs[field][:, :, :1]
    msg = _error(mode, 3, inputs)
    assert f"mode={mode.value}" in msg and "batch 4" in msg and f"{field!r}" in msg, msg


@pytest.mark.parametrize("mode", list(GraphMode))
def test_poisoned_buffers_replay_equals_eager(mode):
    """Garbage in every static buffer before each copy; replays of batches of every size into
    every bucket (padded ones included) equal the forward on the real batch."""
    runner = _runner(poison=True)
    for seed, n in enumerate([4, 3, 1, 2, 4, 3]):
        inputs = make_inputs(mode, _q_lens(mode, n, seed), "cpu", seed=seed)
        tokens = max(_q_lens(mode, n, seed))
        got = runner.run(mode, n, tokens, inputs)
        assert torch.equal(got[: inputs["logit_rows"].shape[0]], model_like(None, inputs)), (
            mode, n, seed)


@pytest.mark.parametrize("skipped", list(FIELDS))
def test_poison_catches_a_field_the_copy_misses(monkeypatch, skipped):
    """The poison test can fail: drop one field from the copy and the replay differs (or the
    garbage index fails loudly)."""
    mode = GraphMode.VERIFY_TREE
    runner = _runner(poison=True)

    def copy_all_but_one(key, static, inputs, dims):
        saved = static[skipped].clone()
        copy_inputs(key, static, inputs, dims)
        static[skipped].copy_(saved)

    monkeypatch.setattr(runner_mod, "copy_inputs", copy_all_but_one)
    inputs = make_inputs(mode, [5, 2, 4], "cpu", seed=1)
    try:
        got = runner.run(mode, 3, 5, inputs)[: inputs["logit_rows"].shape[0]]
    except (IndexError, RuntimeError):
        return
    assert not torch.equal(got, model_like(None, inputs))


def test_padded_bucket_rows_equal_eager():
    runner = _runner()
    inputs = make_inputs(GraphMode.VERIFY_TREE, [5, 2, 4], "cpu", seed=3)
    key = runner.bucket(GraphMode.VERIFY_TREE, 3, 5)
    assert key == GraphKey(GraphMode.VERIFY_TREE, 4, 5)
    got = runner.run(GraphMode.VERIFY_TREE, 3, 5, inputs)
    assert got.shape[0] == 4 * 5  # the bucket's rows; the real ones come first
    assert torch.equal(got[:11], model_like(None, inputs))


def test_bucket_choice_and_static_buffers():
    runner = _runner(buckets=(1, 2, 4, 8))
    assert runner.bucket(GraphMode.DECODE, 3, 1) == GraphKey(GraphMode.DECODE, 4, 1)
    assert runner.bucket(GraphMode.VERIFY_CHAIN, 2, 3) == GraphKey(GraphMode.VERIFY_CHAIN, 2, 4)
    assert runner.bucket(GraphMode.DECODE, 9, 1) is None
    assert runner.bucket(GraphMode.VERIFY_CHAIN, 1, 5) is None
    assert len(runner.keys) == 4 * len(TOKENS)
    assert {f.name for f in fields_for(GraphMode.DECODE)} == set(FIELDS) - {"new_token_mask"}
