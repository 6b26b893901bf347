"""benchmarks/multigpu_bench.py layout names -> (tensor_parallel_size, expert_parallel_size) by
SGLang's --tp T --ep E convention (E divides T, experts in E groups of T / E ranks); no
processes are started."""

from __future__ import annotations

import pytest

from benchmarks.multigpu_bench import parse_layout


@pytest.mark.parametrize("name,want", [
    ("tp4", (4, 1)), ("tp8", (8, 1)), ("tp1", (1, 1)), ("ep8", (8, 8)), ("ep2", (2, 2)),
    ("ep4tp2", (8, 4)), ("ep2tp4", (8, 2)), ("ep1tp8", (8, 1)),
])
def test_layout_names(name, want):
    assert parse_layout(name) == want
    tp, ep = want
    assert tp % ep == 0  # every parsed layout is one LLM accepts


@pytest.mark.parametrize("name", ["", "tp", "tp0", "ep0tp2", "tp4ep2", "TP4", "ep4tp", "dp2",
                                  "tp4 ", "ep8tp2tp2"])
def test_bad_layout_names_raise_naming_the_forms(name):
    with pytest.raises(ValueError, match=r"tpN .*epN .*epNtpM"):
        parse_layout(name)
