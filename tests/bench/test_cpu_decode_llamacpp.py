"""benchmarks/cpu_decode.py run small: every engine asked for is measured at every thread count
and batch size, the JSON carries the ratios to llama.cpp and the memory ratio, llama.cpp
batches exactly as it runs prompts one by one, and a missing llama.cpp is reported, not
fatal."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers import REPO, run_benchmark

sys.path.insert(0, str(REPO))

from benchmarks import cpu_decode  # noqa: E402

SMALL = ["--max-new-tokens", "4", "--repeats", "1", "--threads", "1", "--batch-sizes", "1,2",
         "--idle-timeout", "0"]


def llamacpp_works() -> bool:
    return cpu_decode.llamacpp_installed() and cpu_decode.run_probe("llama.cpp")[0] is not None


def test_cpu_decode_runs_small(tmp_path):
    out = tmp_path / "cpu.md"
    res = run_benchmark("cpu_decode.py", out, "--engines", "flashtree none,flashtree int4,"
                        "llama.cpp", *SMALL)
    report = out.read_text()
    assert 0 < res["weights_rss_over_gguf"] and 0 < res["float_weights_rss_over_gguf"]
    for name in ("flashtree none", "flashtree int4"):
        assert set(res["medians"][name]["1"]) == {"1", "2"}
    if res["llamacpp"]["status"] == "ok":
        assert set(res["medians"]["llama.cpp"]["1"]) == {"1", "2"}
        assert res["none_over_llamacpp_b1"] > 0
        assert res["none_over_llamacpp_b1_engine"] in ("flashtree none", "flashtree int4")
        assert res["default_over_llamacpp_b1"] is None  # no default engine measured
        assert "plain decoding over llama.cpp" in report
    else:
        assert res["none_over_llamacpp_b1"] is None
        assert "llama.cpp: " + res["llamacpp"]["status"] in report


@pytest.mark.skipif(not llamacpp_works(), reason="llama-cpp-python missing or crashing here")
def test_llamacpp_batch_equals_one_by_one():
    ft = cpu_decode.FlashtreeRunner("flashtree none", 6, prefix_caching=False)
    prompts = [ft.encode_chat(p) for p in cpu_decode.PROMPTS[:4]]
    lc = cpu_decode.LlamaCppRunner(6, 4, max(len(p) for p in prompts))
    lc.set_threads(1)
    one_by_one = [lc.generate([p])[0] for p in prompts]
    assert all(len(o) == 6 for o in one_by_one)
    batched = lc.generate(prompts)
    # llama.cpp's AMX kernels round a 4-row decode step differently from a 1-row one, so a
    # near-tie may flip late; sequences mixed up in the batch would differ from the start.
    assert [b[0] for b in batched] == [o[0] for o in one_by_one]
    assert sum(b == o for b, o in zip(batched, one_by_one, strict=True)) >= 3
    # The greedy answer to a question with one clear answer is the same as flashtree's.
    assert one_by_one[0][:3] == ft.generate([prompts[0]])[0][:3]


def test_missing_llamacpp_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_decode, "llamacpp_installed", lambda: False)
    out = tmp_path / "cpu.md"
    threads = torch.get_num_threads()
    try:
        assert cpu_decode.main(["--engines", "flashtree none,llama.cpp", *SMALL, "--out",
                                str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # main sets it process-wide
    assert "llama.cpp: not installed (pip install llama-cpp-python)" in out.read_text()
