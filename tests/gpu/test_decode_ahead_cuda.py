"""Overlapped plain decoding on CUDA, where it is on by default and each queued step replays a
captured graph behind the argmax it reads its tokens from, and the step's read waits for its
own copy only: the same tokens as without the overlap under pressure, the same draft logits on
a DDTree engine mixing plain and speculative steps. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_decode_ahead import check_drafter_steps, check_under_pressure, tiny_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
__all__ = ["tiny_dir"]  # the fixture


def test_overlapped_decoding_under_pressure_on_cuda(tiny_dir):
    check_under_pressure(tiny_dir, "cuda")


def test_a_drafters_plain_steps_overlap_on_cuda(tmp_path):
    check_drafter_steps(tmp_path, "cuda")
