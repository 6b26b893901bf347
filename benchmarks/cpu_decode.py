"""CPU decode throughput: flashtree, Hugging Face transformers and llama.cpp, same model, same run.

Greedy decoding of the embedded default model (SmolLM2-135M-Instruct, one Q4_1 GGUF file for
all engines) by these engines:

- `flashtree none`: plain decoding (`spec="none"`), the GGUF dequantized to float32;
- `flashtree int4`: the same with `quantization="int4"` (the file's 4-bit weights kept);
- `flashtree default` and `flashtree default int4`: `LLM(model="default")`, i.e. speculative
  decoding with the embedded drafter at its default settings, float32 and int4;
- `transformers`: `generate` on the GGUF dequantized to float32;
- `llama.cpp` (optional, through `llama-cpp-python`): the GGUF as it is, left out with the
  reason in the report when it is not installed or its test decode crashes.

Every engine gets the same token ids (8 chat prompts rendered with flashtree's chat template)
and generates exactly `--max-new-tokens` tokens per prompt (flashtree: `ignore_eos=True`;
transformers: `min_new_tokens=max_new_tokens`; llama.cpp: argmax of the logits, EOS treated as
any other token). Prefix caching is off in flashtree (`--prefix-caching` turns it on), so every
engine prefills every prompt in full.

Throughput = generated tokens / wall time of the generate calls, so it INCLUDES prefill (and,
for flashtree, detokenization). Batch 1 runs the 8 prompts one at a time; batch b runs them in
groups of b, one call each (transformers: left padding and an attention mask; llama.cpp: one
sequence id per prompt in the same `llama_batch`). Each engine, thread count and batch size
gets one untimed warm-up run, then `--repeats` timed runs, engines interleaved run by run so
background load hits all alike; the median is reported. Thread counts: torch's intra-op
threads for flashtree and transformers, `n_threads` for llama.cpp.

It also measures, in fresh processes, the resident memory that loading each flashtree path
(and llama.cpp) adds, over the GGUF file's size.

    python benchmarks/cpu_decode.py --max-new-tokens 64 --repeats 3 \
        --out benchmarks/results/DATE-cpu-decode.md

This is a benchmark, not a test: it takes a long while and prints a markdown table; `--out`
also writes the JSON of everything measured beside the report.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_file import write_results  # noqa: E402

PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in simple terms how a refrigerator keeps food cold.",
    "List five tips for staying productive when working from home, with one sentence each.",
    "I am planning a weekend trip to the mountains. What should I pack, and how should I "
    "prepare if the weather forecast says it might rain?",
    "Describe the water cycle step by step: evaporation, condensation, precipitation and "
    "collection. Give an everyday example for each step so that a ten-year-old understands.",
    "You are helping a beginner learn Python. Explain what a list comprehension is, why it can "
    "be more readable than a for loop, when it should be avoided, and show a small example "
    "that squares the even numbers of a list.",
]

# name -> LLM arguments; the "none" engines decode plainly, the "default" ones speculate.
FLASHTREE_ENGINES = {
    "flashtree none": {"spec": "none"},
    "flashtree int4": {"spec": "none", "quantization": "int4"},
    "flashtree default": {},
    "flashtree default int4": {"quantization": "int4"},
}
ENGINES = [*FLASHTREE_ENGINES, "transformers", "llama.cpp"]
REFERENCE = "transformers"  # the greedy-agreement reference

# How the llama-cpp-python 0.3.36 measured here was built; the report names the one in use
# (by whether it has AMX), since they differ 2x. A native build on this CPU (Sapphire Rapids)
# runs Q4_1 through llama.cpp's AMX kernels, but GCC 12 miscompiles them: its
# `_tile_loadconfig` tells the compiler it reads 8 bytes of the 64-byte tile config, the other
# stores are dropped, and the first prefill dies in `ldtilecfg` (SIGSEGV). Hence either:
LLAMACPP_BUILD_AMX = (
    "native build (-march=native, AMX) with GCC 12's tile-config bug patched: in the sdist, "
    "sed -i 's|_tile_loadconfig(&tc);|__asm__ volatile(\"ldtilecfg %0\" :: \"m\"(tc));|' "
    "vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp, then pip install --no-deps "
    "--force-reinstall ./llama_cpp_python-0.3.36"
)
LLAMACPP_BUILD_NO_AMX = (
    'AVX-512 build without AMX: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON '
    "-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON "
    '-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" pip install '
    "--force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36"
)
LLAMACPP_MISSING = "not installed (pip install llama-cpp-python)"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def num_cores() -> int:
    """What `nproc` prints: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def gguf_path() -> Path:
    from flashtree.models.registry import default_model_path

    return Path(default_model_path())


def timed(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


class ForeignLoad:
    """CPU time other processes used (in cores) since `start()`: system busy jiffies from
    /proc/stat minus this process's own. The machine is shared, and on 2 cores one busy
    neighbour stalls every OpenMP barrier of a 2-thread torch, for either engine."""

    def __init__(self) -> None:
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.available = os.path.exists("/proc/stat")
        self.start()

    def _sample(self) -> tuple[int, int, float]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        busy = sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)  # minus idle, iowait
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        own = int(fields[11]) + int(fields[12])  # utime + stime, all threads
        return busy, own, time.perf_counter()

    def start(self) -> None:
        if self.available:
            self._t0 = self._sample()

    def cores(self) -> float:
        """Mean number of cores other processes kept busy since start()."""
        if not self.available:
            return 0.0
        busy, own, t = self._sample()
        b0, o0, t0 = self._t0
        return max(0.0, ((busy - b0) - (own - o0)) / self.hz / max(t - t0, 1e-9))

    def wait_idle(self, threshold: float, timeout: float, log: Callable[[str], None]) -> float:
        """Wait (at most `timeout` s) for a 2 s window in which other processes use fewer than
        `threshold` cores; return the last window's foreign load."""
        if not self.available or timeout <= 0:
            return 0.0
        deadline, told = time.monotonic() + timeout, False
        while True:
            self.start()
            time.sleep(2.0)
            load = self.cores()
            if load < threshold or time.monotonic() > deadline:
                return load
            if not told:
                log(f"    waiting for the machine to go idle (others use {load:.2f} cores)")
                told = True


# ----------------------------------------------------------------------------- engines
class FlashtreeRunner:
    def __init__(self, name: str, max_new_tokens: int, prefix_caching: bool) -> None:
        from flashtree import LLM, SamplingParams

        self.name = name
        self.llm = LLM(model="default", device="cpu", dtype="float32",
                       enable_prefix_caching=prefix_caching, **FLASHTREE_ENGINES[name])
        self.params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
        self.n = max_new_tokens

    def set_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)  # what LLM(threads=...) sets, process-wide

    def encode_chat(self, text: str) -> list[int]:
        assert self.llm.tokenizer is not None
        return self.llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])

    def generate(self, batch: list[list[int]]) -> list[list[int]]:
        outs = self.llm.generate(batch, self.params)
        ids = [o.outputs[0].token_ids for o in outs]
        assert all(len(t) == self.n for t in ids), [len(t) for t in ids]
        return ids


class TransformersRunner:
    name = "transformers"

    def __init__(self, max_new_tokens: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = gguf_path()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
        ).eval()
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id
        self.n = max_new_tokens

    def set_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)

    def chat_ids(self, text: str) -> list[int]:
        return list(self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True,
            return_dict=False,
        ))

    @torch.inference_mode()
    def generate(self, batch: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=self.n,
            min_new_tokens=self.n,
            pad_token_id=self.pad_id,
        )
        ids = out[:, width:].tolist()
        assert all(len(t) == self.n for t in ids), [len(t) for t in ids]
        return ids


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's C API. A batch's prompts are prefilled in one
    `llama_batch`, one sequence id (and KV stream) each, then every `llama_decode` takes one
    token per sequence. Greedy = argmax of the logits; EOS is just another token, so each
    prompt gets exactly `max_new_tokens` tokens."""

    name = "llama.cpp"

    def __init__(self, max_new_tokens: int, max_batch: int, max_prompt: int) -> None:
        import logging

        import llama_cpp as lc

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # quiet loading
        self.lc, self.n = lc, max_new_tokens
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(str(gguf_path()).encode(),
                                                   lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError("llama.cpp could not load the GGUF file")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        per_seq = -(-(max_prompt + max_new_tokens) // 256) * 256  # KV cells per sequence
        params = lc.llama_context_default_params()
        params.n_seq_max = max_batch
        params.n_ctx = per_seq * max_batch
        params.n_batch = params.n_ubatch = max(512, max_prompt * max_batch)
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = lc.llama_batch_init(params.n_batch, 0, 1)

    def set_threads(self, threads: int) -> None:
        self.lc.llama_set_n_threads(self.ctx, threads, threads)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i),
                                       shape=(self.n_vocab,))
        return int(logits.argmax())

    def generate(self, batch: list[list[int]]) -> list[list[int]]:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        prefill = [(t, pos, s, pos == len(p) - 1)
                   for s, p in enumerate(batch) for pos, t in enumerate(p)]
        self._decode(prefill)
        last = [i for i, e in enumerate(prefill) if e[3]]  # batch index of each prompt's logits
        outs = [[self._argmax(i)] for i in last]
        for step in range(self.n - 1):
            self._decode([(o[-1], len(p) + step, s, True)
                          for s, (p, o) in enumerate(zip(batch, outs, strict=True))])
            for s, o in enumerate(outs):
                o.append(self._argmax(s))
        return outs


def llamacpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llamacpp_info() -> dict:
    """Version and compiled-in CPU features of the installed llama.cpp."""
    import llama_cpp as lc

    features = lc.llama_print_system_info().decode(errors="replace").strip()
    return {"version": lc.__version__, "system_info": features}


# ----------------------------------------------------------------------------- probes
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def malloc_trim() -> None:
    """Hand freed heap back to the OS (glibc keeps small frees in its arenas)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def probe(engine: str) -> dict:
    """In this (fresh) process: how much resident memory building `engine` adds. Imports are
    done first; flashtree gets the smallest KV cache (1 page of 16 tokens) and no tokenizer
    (the Hugging Face one adds about 65 MiB that are not weights); each engine decodes a short
    prompt or two, so that weights mapped from a file (llama.cpp's GGUF, flashtree's cached
    packed int4 weights) are touched."""
    from flashtree import LLM, SamplingParams
    from flashtree.models import gguf  # noqa: F401  (imported lazily by LLM)

    if engine == "llama.cpp":
        import llama_cpp  # noqa: F401  (its libraries are code, not weights)
    gc.collect()
    before = rss_bytes()
    kv_bytes = None  # llama.cpp's KV cache is in its RSS growth, not counted apart
    if engine == "llama.cpp":
        runner = LlamaCppRunner(max_new_tokens=2, max_batch=2, max_prompt=8)
        runner.set_threads(1)
        out = runner.generate([[1, 2, 3], [4, 5, 6, 7]])
        assert [len(o) for o in out] == [2, 2], out
    else:
        llm = LLM(model="default", device="cpu", dtype="float32", max_model_len=16,
                  kv_cache_pages=1, skip_tokenizer_init=True, **FLASHTREE_ENGINES[engine])
        kv_bytes = sum(t.nbytes for t in (llm.engine.cache.k, llm.engine.cache.v)
                       if isinstance(t, torch.Tensor))
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2,
                                                       ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 2, out
    gc.collect()
    after = rss_bytes()
    malloc_trim()
    trimmed = rss_bytes()
    return {"rss_growth": after - before, "rss_growth_trimmed": trimmed - before,
            "kv_cache_bytes": kv_bytes}


def run_probe(engine: str) -> tuple[dict | None, str]:
    """`probe(engine)` in a fresh Python: its result, or None and why it failed."""
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", engine]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return None, "timed out"
    if run.returncode == 0:
        return json.loads(run.stdout.strip().splitlines()[-1]), ""
    if run.returncode < 0:
        why = f"killed by {signal.Signals(-run.returncode).name}"
    else:
        why = f"exit status {run.returncode}: {run.stderr.strip().splitlines()[-1:]}"
    return None, why


def memory_report(engines: list[str], gguf_bytes: int, known: dict,
                  log: Callable[[str], None]) -> dict:
    """Per engine: its probe's result with the ratios to the GGUF size (`known`: probes done
    already)."""
    out = {}
    for name in engines:
        res = known.get(name)
        if res is None:
            log(f"measuring the memory of loading {name} in a fresh process ...")
            res, why = run_probe(name)
            if res is None:
                log(f"  memory probe of {name} failed: {why}")
                continue
        res = {**res, "over_gguf": res["rss_growth"] / gguf_bytes,
               "trimmed_over_gguf": res["rss_growth_trimmed"] / gguf_bytes}
        out[name] = res
    return out


# ----------------------------------------------------------------------------- measuring
def run_once(runner, prompts: list[list[int]], batch: int) -> tuple[float, list[list[int]]]:
    """Wall seconds of the generate calls over `prompts` in groups of `batch`, and the
    generated ids in prompt order."""
    seconds, outs = 0.0, []
    for i in range(0, len(prompts), batch):
        dt, ids = timed(lambda i=i: runner.generate(prompts[i : i + batch]))
        seconds += dt
        outs += ids
    return seconds, outs


def measure(runners: list, prompts: list[list[int]], threads: list[int], batches: list[int],
            args: argparse.Namespace, log: Callable[[str], None]) -> tuple[dict, dict, int]:
    """(engine, threads, batch) -> [(tokens/s, foreign cores)] of the kept runs, and -> the
    last run's outputs; and how many contended runs were discarded."""
    load = ForeignLoad()
    runs: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    outputs: dict[tuple[str, int, int], list[list[int]]] = {}
    discarded = 0
    for t in threads:
        for batch in batches:
            for r in runners:
                log(f"warm-up {r.name}, {t} threads, batch {batch}")
                r.set_threads(t)
                run_once(r, prompts, batch)
            for rep in range(args.repeats):
                for r in runners:
                    r.set_threads(t)
                    for attempt in range(args.max_retries + 1):
                        load.wait_idle(args.idle_threshold, args.idle_timeout, log)
                        load.start()
                        seconds, outs = run_once(r, prompts, batch)
                        foreign = load.cores()
                        rate = len(prompts) * args.max_new_tokens / seconds
                        log(f"  {r.name:22s} t{t} b{batch} run {rep + 1}: {seconds:7.2f} s "
                            f"{rate:7.1f} tok/s  (other processes: {foreign:.2f} cores)")
                        if foreign <= args.idle_threshold or attempt == args.max_retries:
                            break
                        discarded += 1
                        log("    contended, discarded; running it again")
                    runs.setdefault((r.name, t, batch), []).append((rate, foreign))
                    outputs[(r.name, t, batch)] = outs
    return runs, outputs, discarded


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(ours: list[list[int]], ref: list[list[int]], eos: set[int], n: int) -> str:
    """Matching greedy prefix per prompt against transformers. A split right where our engine
    emitted EOS is expected (the answer itself matched): transformers' min_new_tokens forbids
    EOS there, ignoring EOS does not, so the two continue differently past the answer's end."""
    prefixes = [common_prefix(a, b) for a, b in zip(ours, ref, strict=True)]
    full = sum(1 for p in prefixes if p == n)
    at_eos = [p for p, a in zip(prefixes, ours, strict=True) if p < n and a[p] in eos]
    diverged = [p for p, a in zip(prefixes, ours, strict=True) if p < n and a[p] not in eos]
    parts = [f"{full + len(at_eos)}/{len(ours)} match up to the answer's end: {full} identical "
             f"for all {n} tokens"]
    if at_eos:
        parts.append(f"{len(at_eos)} identical up to an EOS at token "
                     f"{', '.join(map(str, at_eos))} (suppressed in transformers)")
    if diverged:
        parts.append(f"{len(diverged)} diverge at token {', '.join(map(str, diverged))}")
    return "; ".join(parts) + f"; matching prefix mean {statistics.mean(prefixes):.1f}/{n}"


def medians(runs: dict) -> dict[str, dict[int, dict[int, float]]]:
    """engine -> threads -> batch -> median tokens/s."""
    med: dict[str, dict[int, dict[int, float]]] = {}
    for (name, t, b), vals in runs.items():
        med.setdefault(name, {}).setdefault(t, {})[b] = statistics.median(r for r, _ in vals)
    return med


def best_over_llamacpp(med: dict, names: list[str], threads: int) -> tuple[float | None, str]:
    """The best of `names` at batch 1 and `threads` threads over llama.cpp there, and which."""
    have = [n for n in names if n in med]
    if "llama.cpp" not in med or not have:
        return None, ""
    best = max(have, key=lambda n: med[n][threads][1])
    return med[best][threads][1] / med["llama.cpp"][threads][1], best


# ----------------------------------------------------------------------------- report
def results_table(runs: dict, outputs: dict, med: dict, eos: set[int], n: int,
                  threshold: float) -> tuple[str, int]:
    """The per-run markdown table, and how many kept runs were contended."""
    lines = [
        "| engine | threads | batch | tokens/s (median) | runs (tokens/s) | / transformers "
        "| / llama.cpp | greedy agreement with transformers |",
        "|---|---:|---:|---:|---|---:|---:|---|",
    ]
    contended = 0
    for (name, t, b), vals in runs.items():
        cells = []
        for rate, foreign in vals:
            contended += foreign > threshold
            cells.append(f"{rate:.1f}" + ("*" if foreign > threshold else ""))
        ratios = []
        for ref in (REFERENCE, "llama.cpp"):
            there = ref in med and name != ref
            ratios.append(f"{med[name][t][b] / med[ref][t][b]:.2f}x" if there else "")
        if name == REFERENCE:
            note = "(reference)"
        elif REFERENCE in med:
            note = agreement(outputs[(name, t, b)], outputs[(REFERENCE, t, b)], eos, n)
        else:
            note = ""
        lines.append(f"| {name} | {t} | {b} | {med[name][t][b]:.1f} | {', '.join(cells)} | "
                     f"{ratios[0]} | {ratios[1]} | {note} |")
    return "\n".join(lines), contended


def summary_table(med: dict, threads: list[int], batches: list[int]) -> str:
    """Engines by (threads, batch): median tokens/s."""
    cols = [(t, b) for t in threads for b in batches]
    lines = ["| engine | " + " | ".join(f"{t} thr, batch {b}" for t, b in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for name, by_t in med.items():
        lines.append(f"| {name} | " + " | ".join(f"{by_t[t][b]:.1f}" for t, b in cols) + " |")
    return "\n".join(lines)


def memory_table(memory: dict, gguf_bytes: int) -> str:
    mib = 1 << 20
    lines = [f"GGUF file: {gguf_bytes / mib:.1f} MiB. Resident memory added by loading each "
             "engine in a fresh process (imports done before; flashtree with a 1-page KV cache, "
             "llama.cpp after decoding 2 short prompts, its file-mapped weights included):",
             "",
             "| engine | RSS growth (MiB) | / GGUF | after malloc_trim (MiB) | / GGUF "
             "| KV cache in it (MiB) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, m in memory.items():
        kv = m["kv_cache_bytes"]
        lines.append(f"| {name} | {m['rss_growth'] / mib:.1f} | {m['over_gguf']:.2f} | "
                     f"{m['rss_growth_trimmed'] / mib:.1f} | {m['trimmed_over_gguf']:.2f} | "
                     f"{'n/a' if kv is None else f'{kv / mib:.1f}'} |")
    return "\n".join(lines)


def headline(med: dict, all_cores: int) -> tuple[list[str], dict]:
    """The batch-1 ratios to llama.cpp, as report lines and JSON keys."""
    none_r, none_best = best_over_llamacpp(med, ["flashtree none", "flashtree int4"], all_cores)
    dflt_r, dflt_best = best_over_llamacpp(
        med, ["flashtree default", "flashtree default int4"], all_cores)
    data = {"none_over_llamacpp_b1": none_r, "none_over_llamacpp_b1_engine": none_best,
            "default_over_llamacpp_b1": dflt_r, "default_over_llamacpp_b1_engine": dflt_best}
    lines = []
    for label, r, best in (("plain decoding", none_r, none_best),
                           ("default (speculative)", dflt_r, dflt_best)):
        if r is not None:
            lines.append(f"- {label} over llama.cpp, batch 1, {all_cores} threads: **{r:.2f}x** "
                         f"(best is `{best}`: {med[best][all_cores][1]:.1f} against "
                         f"{med['llama.cpp'][all_cores][1]:.1f} tokens/s)")
    return lines, data


def parse_ints(text: str) -> list[int]:
    return list(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,4", help="comma-separated, each dividing 8")
    ap.add_argument("--threads", default=None,
                    help="comma-separated thread counts, every engine at each (default: 1,nproc)")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help=f"comma-separated subset of: {', '.join(ENGINES)} (default: all)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="leave flashtree's prefix caching on (off by default: the other engines "
                    "prefill every prompt in full)")
    ap.add_argument("--llamacpp-note", default=None,
                    help="how llama-cpp-python was built, for the report (default: one of the "
                    "two builds this file describes, told apart by AMX)")
    ap.add_argument("--out", default=None,
                    help="write the markdown report here and its JSON beside it (.json)")
    ap.add_argument("--idle-threshold", type=float, default=0.25,
                    help="a timed run counts as contended when other processes used more than "
                    "this many cores during it (default 0.25)")
    ap.add_argument("--idle-timeout", type=float, default=600.0,
                    help="seconds to wait for an idle machine before each timed run; 0: don't")
    ap.add_argument("--max-retries", type=int, default=3,
                    help="times a contended timed run is discarded and redone (default 3)")
    ap.add_argument("--probe", choices=[*FLASHTREE_ENGINES, "llama.cpp"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:  # internal: one engine's memory, in a fresh process
        print(json.dumps(probe(args.probe)))
        return 0
    batches = parse_ints(args.batch_sizes)
    if any(b < 1 or len(PROMPTS) % b for b in batches):
        ap.error(f"--batch-sizes must divide {len(PROMPTS)}, got {args.batch_sizes}")
    threads = parse_ints(args.threads) if args.threads else list(dict.fromkeys([1, num_cores()]))
    if any(t < 1 for t in threads):
        ap.error(f"--threads must be >= 1, got {args.threads}")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if any(e not in ENGINES for e in engines):
        ap.error(f"--engines: unknown {[e for e in engines if e not in ENGINES]}")
    if args.max_new_tokens < 1 or args.repeats < 1:
        ap.error("--max-new-tokens and --repeats must be >= 1")
    all_cores = num_cores() if num_cores() in threads else max(threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # llama.cpp: left out when missing or when a test decode in a fresh process fails.
    llamacpp: dict = {"status": "not measured"}
    probed: dict = {}
    if "llama.cpp" in engines:
        if not llamacpp_installed():
            llamacpp = {"status": LLAMACPP_MISSING}
        else:
            log("checking that llama.cpp decodes (fresh process) ...")
            res, why = run_probe("llama.cpp")
            if res is None:
                llamacpp = {"status": f"left out: its test decode failed ({why}); rebuild "
                            f"it, e.g. {LLAMACPP_BUILD_NO_AMX}"}
            else:
                probed["llama.cpp"] = res
                info = llamacpp_info()
                amx = "AMX_INT8 = 1" in info["system_info"]
                note = LLAMACPP_BUILD_AMX if amx else LLAMACPP_BUILD_NO_AMX
                llamacpp = {"status": "ok", **info, "build": args.llamacpp_note or note}
        if llamacpp["status"] != "ok":
            log(f"llama.cpp: {llamacpp['status']}")
            engines.remove("llama.cpp")

    log(f"loading {', '.join(engines)} ...")
    flashtree = [FlashtreeRunner(e, args.max_new_tokens, args.prefix_caching)
                 for e in engines if e in FLASHTREE_ENGINES]
    tokenizer_owner = flashtree[0] if flashtree else FlashtreeRunner(
        "flashtree none", args.max_new_tokens, args.prefix_caching)
    prompts = [tokenizer_owner.encode_chat(p) for p in PROMPTS]
    eos = set(tokenizer_owner.llm.engine.eos_token_ids)
    runners: list = list(flashtree)
    if "transformers" in engines:
        hf = TransformersRunner(args.max_new_tokens)
        if [hf.chat_ids(p) for p in PROMPTS] != prompts:
            log("warning: transformers renders the chat prompts differently; using flashtree's")
        runners.append(hf)
    if "llama.cpp" in engines:
        runners.append(LlamaCppRunner(args.max_new_tokens, max(batches),
                                      max(len(p) for p in prompts)))

    runs, outputs, discarded = measure(runners, prompts, threads, batches, args, log)
    med = medians(runs)

    gguf_bytes = gguf_path().stat().st_size
    mem_engines = ["flashtree none", "flashtree int4",
                   *(["llama.cpp"] if "llama.cpp" in probed else [])]
    memory = memory_report(mem_engines, gguf_bytes, probed, log)

    table, contended = results_table(runs, outputs, med, eos, args.max_new_tokens,
                                     args.idle_threshold)
    worst = max(f for vals in runs.values() for _, f in vals)
    head_lines, head_data = headline(med, all_cores)

    import transformers

    lens = [len(p) for p in prompts]
    if llamacpp["status"] == "ok":
        llama_line = (f"- llama.cpp: llama-cpp-python {llamacpp['version']}, same GGUF and token "
                      "ids, argmax of the logits (EOS ignored), `n_threads` = the thread count, a "
                      "batch's prompts as sequences of one `llama_batch`; build: "
                      f"`{llamacpp['build']}`; compiled features: `{llamacpp['system_info']}`")
    else:
        llama_line = f"- llama.cpp: {llamacpp['status']}"
    report = "\n".join([
        "# CPU decode throughput: flashtree vs transformers vs llama.cpp",
        "",
        f"- command: `{shlex.join([os.path.basename(sys.executable), *sys.argv])}`",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: nproc {num_cores()}, CPU `{cpu_model()}`, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}",
        "- model: SmolLM2-135M-Instruct (embedded `model='default'`, Q4_1 GGUF; dequantized to "
        "float32 by `flashtree none`/`default` and transformers, 4-bit weights kept by the "
        "`int4` engines and llama.cpp), greedy; `default` = speculative decoding with the "
        "embedded drafter at its default settings",
        llama_line,
        f"- workload: {len(prompts)} chat prompts of {min(lens)}-{max(lens)} tokens (chat "
        f"template), exactly {args.max_new_tokens} new tokens each; batch b = the prompts in "
        f"groups of b, one generate call each; threads {', '.join(map(str, threads))}; "
        f"flashtree prefix caching {'on' if args.prefix_caching else 'off'}",
        "- tokens/s = generated tokens / wall time of the whole generate call(s), **prefill "
        f"included**; one warm-up run each, median of {args.repeats} runs, engines interleaved",
        f"- shared machine: each timed run waited for other processes to use < "
        f"{args.idle_threshold} cores and was redone (at most {args.max_retries} times) when "
        f"they used more during it; {discarded} runs discarded, {contended} kept runs still "
        f"contended (marked *), at most {worst:.2f} cores used by others in a kept run",
        *head_lines,
        "",
        summary_table(med, threads, batches),
        "",
        table,
        "",
        memory_table(memory, gguf_bytes),
        "",
    ])
    int4_mem, float_mem = memory.get("flashtree int4"), memory.get("flashtree none")
    data = {
        **head_data,
        "weights_rss_over_gguf": int4_mem and int4_mem["over_gguf"],
        "weights_rss_over_gguf_trimmed": int4_mem and int4_mem["trimmed_over_gguf"],
        "float_weights_rss_over_gguf": float_mem and float_mem["over_gguf"],
        "llamacpp_rss_over_gguf": memory.get("llama.cpp", {}).get("over_gguf"),
        "all_cores_threads": all_cores,
        "medians": {n: {str(t): {str(b): v for b, v in bs.items()} for t, bs in ts.items()}
                    for n, ts in med.items()},
        "runs": [{"engine": n, "threads": t, "batch": b, "tokens_per_s": [r for r, _ in v],
                  "foreign_cores": [f for _, f in v]} for (n, t, b), v in runs.items()],
        "memory": memory, "gguf_bytes": gguf_bytes, "llamacpp": llamacpp,
        "engines": engines, "threads": threads, "batch_sizes": batches,
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "prefix_caching": args.prefix_caching, "prompt_tokens": lens,
        "discarded_runs": discarded, "contended_runs": contended, "cpu": cpu_model(),
        "nproc": num_cores(),
    }
    if args.out:
        write_results(Path(args.out), report, data)
        log(f"wrote {args.out} and {Path(args.out).with_suffix('.json')}")
    else:
        print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
