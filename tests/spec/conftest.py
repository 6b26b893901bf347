"""A tiny Qwen3 target over 5 tokens and a random reference drafter for it, shared by the
speculative-decoding tests."""

from __future__ import annotations

import pytest

from tests.tiny import save_reference_drafter, save_tiny_qwen3


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = save_tiny_qwen3(root / "t", seed=5, vocab_size=5, initializer_range=0.3)
    drafter = save_reference_drafter(root / "d", target, seed=7, block_size=8,
                                     initializer_range=0.3)
    return target, drafter
