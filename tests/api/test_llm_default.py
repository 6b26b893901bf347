"""The LLM API on the embedded default model (SmolLM2-135M-Instruct GGUF): stop handling,
chat template, input validation, and the CLI started the way users start it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flashtree import SamplingParams

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


def test_chat_applies_template_and_stops_on_eos(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.outputs.eos_token_ids
    assert "<|im_end|>" not in out.text


def test_ignore_eos_runs_to_max_tokens(llm):
    conv = [{"role": "user", "content": "Say hi."}]
    natural = llm.chat(conv, SamplingParams(max_tokens=60, **GREEDY))[0].outputs[0]
    forced = llm.chat(conv, SamplingParams(max_tokens=len(natural.token_ids) + 5,
                                           ignore_eos=True, **GREEDY))[0].outputs[0]
    assert natural.finish_reason == "stop"
    assert forced.finish_reason == "length"
    assert forced.token_ids[: len(natural.token_ids)] == natural.token_ids
    assert len(forced.token_ids) == len(natural.token_ids) + 5


def test_stop_string_truncates_text(llm):
    conv = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    full = llm.chat(conv, SamplingParams(max_tokens=60, **GREEDY))[0].outputs[0].text
    assert "5" in full
    cut = llm.chat(conv, SamplingParams(max_tokens=60, stop=["5"], **GREEDY))[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index("5")]


def test_stop_token_ids(llm):
    conv = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    full = llm.chat(conv, SamplingParams(max_tokens=60, **GREEDY))[0].outputs[0].token_ids
    stop_id = full[3]
    cut = llm.chat(conv, SamplingParams(max_tokens=60, stop_token_ids=[stop_id], **GREEDY))
    assert cut[0].outputs[0].token_ids == full[: full.index(stop_id) + 1]
    assert cut[0].outputs[0].finish_reason == "stop"


def test_prompt_forms_and_params_list(llm):
    ids = llm.tokenizer.encode("The capital of France is")
    sp = SamplingParams(max_tokens=5, **GREEDY)
    by_text = llm.generate("The capital of France is", sp)[0].outputs[0].token_ids
    by_ids = llm.generate(ids, sp)[0].outputs[0].token_ids
    mixed = llm.generate(["The capital of France is", ids], [sp, sp])
    assert by_text == by_ids == mixed[0].outputs[0].token_ids == mixed[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="3 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [sp, sp, sp])


def test_prompt_longer_than_max_model_len_is_rejected(llm):
    with pytest.raises(ValueError, match="max_model_len is 256"):
        llm.generate([[1] * 300], SamplingParams(max_tokens=4))
    # The engine still serves other requests afterwards.
    assert llm.generate("Hello", SamplingParams(max_tokens=3, **GREEDY))[0].outputs[0].token_ids


def test_generation_stops_at_max_model_len(llm):
    prompt = [1] * 250
    out = llm.generate([prompt], SamplingParams(max_tokens=None, ignore_eos=True, **GREEDY))
    assert len(out[0].outputs[0].token_ids) == 256 - 250
    assert out[0].outputs[0].finish_reason == "length"


def test_out_of_vocab_ids_are_rejected(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 10**6]], SamplingParams(max_tokens=2))


def test_cli_chat_matches_library(llm):
    message = "Name a fruit."
    expected = llm.chat([{"role": "user", "content": message}],
                        SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0].text
    run = subprocess.run(
        [sys.executable, "-m", "flashtree", "chat", "-m", message, "--max-tokens", "12",
         "--device", "cpu"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == expected.strip()


def test_cli_reports_bad_input_without_traceback():
    run = subprocess.run(
        [sys.executable, "-m", "flashtree", "generate", "hi", "--model", "/nonexistent/model"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2
    assert "does not exist" in run.stderr and "Traceback" not in run.stderr


def test_threads_option_sets_torch_threads_and_keeps_the_tokens(llm):
    """`--threads 1` (a CPU shared with busy processes) decodes the library's tokens; a count
    below 1 is refused naming the option."""
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = llm.generate("The capital of France is", params)[0].outputs[0].text
    code = ("import torch; from flashtree import LLM, SamplingParams; "
            "llm = LLM(model='default', device='cpu', threads=1); "
            "out = llm.generate('The capital of France is', "
            "SamplingParams(temperature=0, max_tokens=8)); "
            "print(torch.get_num_threads()); print(out[0].outputs[0].text)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    threads, text = run.stdout.split("\n", 1)
    assert threads == "1" and text.strip() == expected.strip()
    bad = subprocess.run([sys.executable, "-m", "flashtree", "generate", "hi", "--threads",
                          "0", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "threads must be >= 1" in bad.stderr
