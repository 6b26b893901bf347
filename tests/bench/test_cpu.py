"""benchmarks/cpu.py small: every engine asked for is measured at every thread count and batch
size with the plain tokens transformers decodes, the JSON carries the ratios to llama.cpp (or
says why not) and the memory ratios, the weight formats' errors are what their precision
allows, and llama.cpp batches exactly as it runs prompts one by one."""

from __future__ import annotations

import pytest

from benchmarks import cpu
from tests.bench.scripts import check_goals, run_script


def test_decode_and_kernels_run_small(tmp_path):
    out = tmp_path / "cpu.md"
    data = run_script("cpu", out, "--sections", "decode,kernels", "--engines",
                      "flashtree none,flashtree int4,transformers,llama.cpp", "--max-new-tokens",
                      "4", "--repeats", "1", "--threads", "1", "--batch-sizes", "1,2",
                      "--idle-timeout", "0", "--max-retries", "0", "--layers", "2", "--rows",
                      "1,4")
    report = out.read_text()
    for name in ("flashtree none", "flashtree int4", "transformers"):
        assert set(data["medians"][name]["1"]) == {"1", "2"}
    # Plain float32 decoding of the dequantized GGUF is transformers' greedy decoding.
    assert "| flashtree none | 1 | 1 |" in report
    assert [line for line in report.splitlines() if line.startswith("| flashtree none | 1 |")
            and "8/8 match up to the answer's end: 8 identical" not in line] == []
    # Packed int4 weights stay near the GGUF's size; float32 ones are 4 bytes a weight.
    assert 0 < data["weights_rss_over_gguf"] < 2 < data["float_weights_rss_over_gguf"]
    if data["llamacpp"]["status"] == "ok":
        assert data["none_over_llamacpp_b1"] > 0 and data["default_over_llamacpp_b1"] is None
    else:
        assert data["none_over_llamacpp_b1"] is None
        assert "llama.cpp: " + data["llamacpp"]["status"] in report
    check_goals(out, data, ("none_over_llamacpp_b1", "default_over_llamacpp_b1",
                            "weights_rss_over_gguf"))
    rows = data["kernels"]["rows"]
    assert {(r["rows"], r["format"]) for r in rows} == {
        (n, f) for n in (1, 4) for f in cpu.FORMATS}
    errors = {r["format"]: r["max_rel_error"] for r in rows}
    # float32 is the reference; int4 holds the Q4_1 weights exactly (float32 sums: ~1e-6);
    # bfloat16 activations or weights round at 2^-9 relative, int8 per row at 1/254 of a row's
    # largest weight.
    assert errors["float32"] == 0 and errors["int4, float32 activations"] < 1e-5
    assert all(errors[f] < 3e-2 for f in errors)


def llamacpp_works() -> bool:
    return cpu.llamacpp_installed() and cpu.run_probe("llama.cpp")[0] is not None


@pytest.mark.skipif(not llamacpp_works(), reason="llama-cpp-python missing or crashing here")
def test_llamacpp_batch_equals_one_by_one():
    ft = cpu.FlashtreeRunner("flashtree none", 6, prefix_caching=False)
    prompts = [ft.encode_chat(p) for p in cpu.PROMPTS[:4]]
    lc = cpu.LlamaCppRunner(6, 4, max(len(p) for p in prompts))
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
