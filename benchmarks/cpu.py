"""The CPU against llama.cpp, on the embedded default model (SmolLM2-135M-Instruct, one Q4_1
GGUF file for every engine).

  decode   greedy decoding side by side in one run: flashtree plain (`none`: the GGUF
           dequantized to float32; `int4`: its 4-bit weights kept), flashtree's default
           speculative engine (both), transformers `generate` and llama.cpp (llama-cpp-python,
           optional: left out with the reason when it is missing or its test decode crashes);
           the same token ids (8 chat prompts), exactly --max-new-tokens each (EOS ignored),
           at every --threads count and --batch-sizes size, prefill included (tokens/s =
           generated tokens / wall time of the generate calls); one warm-up run, then
           --repeats runs, engines interleaved, each waiting for an idle machine and redone
           when other processes used more than --idle-threshold cores; the median. Then each
           engine loaded in a fresh process: the resident memory its weights add over the GGUF
  kernels  one token's matmuls of the default model (30 layers of q/k/v, o, gate/up, down and
           the tied LM head, each weight its own tensor, so a pass streams them from memory as
           a decode step does) as float32, bfloat16, packed int4 (group 32, the layout GGUF
           Q4_0/Q4_1 map to) and int8 per row, at --rows rows, 1 thread and all cores; each
           format's largest relative error against float32 on the same weights

    python -m benchmarks.cpu --max-new-tokens 64 --repeats 3 --out benchmarks/results/DATE-cpu.md
    python -m benchmarks.cpu --sections kernels --out benchmarks/results/DATE-cpu-kernels.md

JSON keys: `none_over_llamacpp_b1`, `default_over_llamacpp_b1` (the best flashtree engine of each
kind over llama.cpp at batch 1 on all cores) and `weights_rss_over_gguf` (int4).

llama.cpp's speed depends on its build: on this project's CPU machine (AMX) the stock
`pip install llama-cpp-python==0.3.36` crashes in its first decode (GCC 12 drops the AMX tile
configuration's writes); LLAMACPP_BUILDS gives the patched AMX build (about 2x faster) and one
without AMX."""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flashtree.bench.results import cpu_model, int_list, num_cores, write_results
from flashtree.bench.timing import wall_s

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
FLASHTREE_ENGINES = {"flashtree none": {"spec": "none"},
                     "flashtree int4": {"spec": "none", "quantization": "int4"},
                     "flashtree default": {}, "flashtree default int4": {"quantization": "int4"}}
ENGINES = [*FLASHTREE_ENGINES, "transformers", "llama.cpp"]
REFERENCE = "transformers"  # the greedy-agreement reference
# How the llama-cpp-python 0.3.36 measured here was built (told apart by AMX); they differ 2x.
# A native build on Sapphire Rapids runs Q4_1 through AMX kernels, but GCC 12 miscompiles them
# (its `_tile_loadconfig` reads 8 of the 64 config bytes; the first prefill dies in ldtilecfg).
LLAMACPP_BUILDS = {
    True: "native build (-march=native, AMX) with GCC 12's tile-config bug patched: in the "
    "sdist, sed -i 's|_tile_loadconfig(&tc);|__asm__ volatile(\"ldtilecfg %0\" :: \"m\"(tc));|' "
    "vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp, then pip install --no-deps "
    "--force-reinstall ./llama_cpp_python-0.3.36",
    False: 'AVX-512 build without AMX: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON '
    "-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON "
    '-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" pip '
    "install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36"}
LLAMACPP_MISSING = "not installed (pip install llama-cpp-python)"
# The default model's matmuls: hidden, intermediate, KV width, vocab, layers, int4 group.
HIDDEN, INTER, KV, VOCAB, LAYERS, GROUP = 576, 1536, 192, 49152, 30, 32
LAYER = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def gguf_path() -> Path:
    from flashtree.models.registry import default_model_path

    return Path(default_model_path())


class ForeignLoad:
    """CPU time other processes used (in cores) since `start()`: system busy jiffies from
    /proc/stat minus this process's own. On 2 cores one busy neighbour stalls every OpenMP
    barrier of a 2-thread torch, for any engine."""

    def __init__(self) -> None:
        self.hz, self.available = os.sysconf("SC_CLK_TCK"), os.path.exists("/proc/stat")
        self.start()

    def _sample(self) -> tuple[int, int, float]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        busy = sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)  # minus idle, iowait
        return busy, int(fields[11]) + int(fields[12]), time.perf_counter()  # utime + stime

    def start(self) -> None:
        self._t0 = self._sample() if self.available else None

    def cores(self) -> float:
        if not self.available:
            return 0.0
        (busy, own, t), (b0, o0, t0) = self._sample(), self._t0
        return max(0.0, ((busy - b0) - (own - o0)) / self.hz / max(t - t0, 1e-9))

    def wait_idle(self, threshold: float, timeout: float) -> float:
        """Wait (at most `timeout` s) for a 2 s window in which other processes use fewer than
        `threshold` cores; return the last window's load."""
        deadline, told = time.monotonic() + timeout, False
        while self.available and timeout > 0:
            self.start()
            time.sleep(2.0)
            if (load := self.cores()) < threshold or time.monotonic() > deadline:
                return load
            if not told:
                log(f"    waiting for the machine to go idle (others use {load:.2f} cores)")
                told = True
        return 0.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class FlashtreeRunner:
    def __init__(self, name: str, max_new_tokens: int, prefix_caching: bool) -> None:
        from flashtree import LLM, SamplingParams

        self.name, self.n = name, max_new_tokens
        self.llm = LLM(model="default", device="cpu", dtype="float32",
                       enable_prefix_caching=prefix_caching, **FLASHTREE_ENGINES[name])
        self.params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)

    def set_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)  # what LLM(threads=...) sets, process-wide

    def encode_chat(self, text: str) -> list[int]:
        return self.llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])

    def generate(self, batch: list[list[int]]) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in self.llm.generate(batch, self.params)]


class TransformersRunner:
    name = "transformers"

    def __init__(self, max_new_tokens: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = gguf_path()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id
        self.n = max_new_tokens

    set_threads = FlashtreeRunner.set_threads

    @torch.inference_mode()
    def generate(self, batch: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in batch)  # left padding under an attention mask
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=self.n, min_new_tokens=self.n,
                                  pad_token_id=self.pad_id)
        return out[:, width:].tolist()


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's C API: a batch's prompts prefilled in one
    `llama_batch`, one sequence id each, then one token per sequence per `llama_decode`;
    greedy = argmax of the logits, EOS just another token."""

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
        params = lc.llama_context_default_params()
        params.n_seq_max = max_batch
        params.n_ctx = -(-(max_prompt + max_new_tokens) // 256) * 256 * max_batch
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
        if (rc := self.lc.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        import numpy as np

        return int(np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i),
                                         shape=(self.n_vocab,)).argmax())

    def generate(self, batch: list[list[int]]) -> list[list[int]]:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        prefill = [(t, pos, s, pos == len(p) - 1)
                   for s, p in enumerate(batch) for pos, t in enumerate(p)]
        self._decode(prefill)
        outs = [[self._argmax(i)] for i, e in enumerate(prefill) if e[3]]
        for step in range(self.n - 1):
            self._decode([(o[-1], len(p) + step, s, True)
                          for s, (p, o) in enumerate(zip(batch, outs, strict=True))])
            for s, o in enumerate(outs):
                o.append(self._argmax(s))
        return outs


def llamacpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def probe(engine: str) -> dict:
    """In this (fresh) process: the resident memory building `engine` adds, imports done
    first; flashtree with a 1-page KV cache and no tokenizer; each engine decodes a short
    prompt or two, so that weights mapped from a file are touched."""
    from flashtree import LLM, SamplingParams
    from flashtree.models import gguf  # noqa: F401  (imported lazily by LLM)

    if engine == "llama.cpp":
        import llama_cpp  # noqa: F401  (its libraries are code, not weights)
    gc.collect()
    before, kv_bytes = rss_bytes(), None  # llama.cpp's KV cache is in its growth
    if engine == "llama.cpp":
        runner = LlamaCppRunner(max_new_tokens=2, max_batch=2, max_prompt=8)
        runner.set_threads(1)
        assert [len(o) for o in runner.generate([[1, 2, 3], [4, 5, 6, 7]])] == [2, 2]
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
    try:  # hand freed heap back to the OS (glibc keeps small frees in its arenas)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return {"rss_growth": after - before, "rss_growth_trimmed": rss_bytes() - before,
            "kv_cache_bytes": kv_bytes}


def run_probe(engine: str) -> tuple[dict | None, str]:
    """`probe(engine)` in a fresh Python: its result, or None and why it failed."""
    cmd = [sys.executable, "-m", "benchmarks.cpu", "--probe", engine]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                             cwd=Path(__file__).resolve().parents[1])
    except subprocess.TimeoutExpired:
        return None, "timed out"
    if run.returncode == 0:
        return json.loads(run.stdout.strip().splitlines()[-1]), ""
    return None, (f"killed by signal {-run.returncode}" if run.returncode < 0 else
                  f"exit status {run.returncode}: {run.stderr.strip().splitlines()[-1:]}")


def measure(runners: list, prompts: list[list[int]], args) -> tuple[dict, dict, int]:
    """(engine, threads, batch) -> [(tokens/s, foreign cores)] of the kept runs, and -> the
    last run's outputs; how many contended runs were discarded."""
    load, runs, outputs, discarded = ForeignLoad(), {}, {}, 0

    def once(r, batch: int) -> tuple[float, list[list[int]]]:
        timed = [wall_s(lambda i=i: r.generate(prompts[i: i + batch]))
                 for i in range(0, len(prompts), batch)]
        outs = [ids for _, part in timed for ids in part]
        assert all(len(o) == args.max_new_tokens for o in outs), [len(o) for o in outs]
        return sum(s for s, _ in timed), outs

    for t in args.threads:
        for batch in args.batch_sizes:
            for r in runners:
                log(f"warm-up {r.name}, {t} threads, batch {batch}")
                r.set_threads(t)
                once(r, batch)
            for rep in range(args.repeats):
                for r in runners:
                    r.set_threads(t)
                    for attempt in range(args.max_retries + 1):
                        load.wait_idle(args.idle_threshold, args.idle_timeout)
                        load.start()
                        seconds, outs = once(r, batch)
                        foreign, rate = load.cores(), len(prompts) * args.max_new_tokens / seconds
                        log(f"  {r.name:22s} t{t} b{batch} run {rep + 1}: {rate:7.1f} tok/s  "
                            f"(other processes: {foreign:.2f} cores)")
                        if foreign <= args.idle_threshold or attempt == args.max_retries:
                            break
                        discarded += 1
                    runs.setdefault((r.name, t, batch), []).append((rate, foreign))
                    outputs[r.name, t, batch] = outs
    return runs, outputs, discarded


def agreement(ours: list[list[int]], ref: list[list[int]], eos: set[int], n: int) -> str:
    """Matching greedy prefix per prompt against transformers. A split right where ours emitted
    EOS is expected: transformers' min_new_tokens forbids EOS there, ignoring EOS does not."""
    prefixes = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                for a, b in zip(ours, ref, strict=True)]
    full = sum(p == n for p in prefixes)
    at_eos = [p for p, a in zip(prefixes, ours) if p < n and a[p] in eos]
    diverged = [p for p, a in zip(prefixes, ours) if p < n and a[p] not in eos]
    return (f"{full + len(at_eos)}/{len(ours)} match up to the answer's end: {full} identical "
            f"for all {n} tokens" + (f"; {len(at_eos)} identical up to an EOS at token "
                                     f"{', '.join(map(str, at_eos))}" if at_eos else "")
            + (f"; {len(diverged)} diverge at token {', '.join(map(str, diverged))}"
               if diverged else "") + f"; matching prefix mean {statistics.mean(prefixes):.1f}")


def decode(args) -> tuple[dict, list[str]]:
    engines = list(args.engines)
    llamacpp: dict = {"status": "not measured"}
    probed = {}
    if "llama.cpp" in engines:
        if not llamacpp_installed():
            llamacpp = {"status": LLAMACPP_MISSING}
        elif (res := run_probe("llama.cpp"))[0] is None:
            llamacpp = {"status": f"left out: its test decode failed ({res[1]}); rebuild it, "
                        f"e.g. {LLAMACPP_BUILDS[False]}"}
        else:
            import llama_cpp as lc

            probed["llama.cpp"] = res[0]
            features = lc.llama_print_system_info().decode(errors="replace").strip()
            llamacpp = {"status": "ok", "version": lc.__version__, "system_info": features,
                        "build": args.llamacpp_note or LLAMACPP_BUILDS["AMX_INT8 = 1" in features]}
        if llamacpp["status"] != "ok":
            log(f"llama.cpp: {llamacpp['status']}")
            engines.remove("llama.cpp")
    log(f"loading {', '.join(engines)} ...")
    flashtree = [FlashtreeRunner(e, args.max_new_tokens, args.prefix_caching)
                 for e in engines if e in FLASHTREE_ENGINES]
    owner = flashtree[0] if flashtree else FlashtreeRunner("flashtree none", 1, False)
    prompts = [owner.encode_chat(p) for p in PROMPTS]
    eos = set(owner.llm.engine.outputs.eos_token_ids)
    runners = list(flashtree)
    if "transformers" in engines:
        runners.append(TransformersRunner(args.max_new_tokens))
    if "llama.cpp" in engines:
        runners.append(LlamaCppRunner(args.max_new_tokens, max(args.batch_sizes),
                                      max(map(len, prompts))))
    runs, outputs, discarded = measure(runners, prompts, args)
    med = {(n, t, b): statistics.median(r for r, _ in v) for (n, t, b), v in runs.items()}
    gguf = gguf_path().stat().st_size
    memory = {}
    for name in ["flashtree none", "flashtree int4", *probed]:
        got = probed.get(name) or run_probe(name)[0]
        if got is not None:
            memory[name] = {**got, "over_gguf": got["rss_growth"] / gguf,
                            "trimmed_over_gguf": got["rss_growth_trimmed"] / gguf}
    top = num_cores() if num_cores() in args.threads else max(args.threads)
    data: dict = {"llamacpp": llamacpp, "engines": engines, "all_cores_threads": top,
                  "prompt_tokens": [len(p) for p in prompts], "discarded_runs": discarded,
                  "gguf_bytes": gguf, "memory": memory,
                  "runs": [{"engine": n, "threads": t, "batch": b,
                            "tokens_per_s": [r for r, _ in v], "foreign_cores": [f for _, f in v]}
                           for (n, t, b), v in runs.items()],
                  "medians": {n: {str(t): {str(b): med[n, t, b] for b in args.batch_sizes}
                                  for t in args.threads} for n in dict.fromkeys(
                                      n for n, _, _ in runs)}}
    for key, kind in (("none_over_llamacpp_b1", ("flashtree none", "flashtree int4")),
                      ("default_over_llamacpp_b1", ("flashtree default",
                                                    "flashtree default int4"))):
        have = [n for n in kind if (n, top, 1) in med]
        best = max(have, key=lambda n: med[n, top, 1]) if have else None
        there = best is not None and ("llama.cpp", top, 1) in med
        data[key] = med[best, top, 1] / med["llama.cpp", top, 1] if there else None
        data[f"{key}_engine"] = best if there else None
    for key, name, field in (("weights_rss_over_gguf", "flashtree int4", "over_gguf"),
                             ("weights_rss_over_gguf_trimmed", "flashtree int4",
                              "trimmed_over_gguf"),
                             ("float_weights_rss_over_gguf", "flashtree none", "over_gguf"),
                             ("llamacpp_rss_over_gguf", "llama.cpp", "over_gguf")):
        data[key] = memory.get(name, {}).get(field)
    lines = ["## Decode, greedy, prefill included", "",
             "- llama.cpp: " + (f"llama-cpp-python {llamacpp['version']}, build: "
                                f"`{llamacpp['build']}`; features: `{llamacpp['system_info']}`"
                                if llamacpp["status"] == "ok" else llamacpp["status"]),
             f"- {len(prompts)} chat prompts of {min(map(len, prompts))}-"
             f"{max(map(len, prompts))} tokens, exactly {args.max_new_tokens} new tokens each; "
             f"median of {args.repeats} interleaved runs; flashtree prefix caching "
             f"{'on' if args.prefix_caching else 'off'}; {discarded} contended runs discarded "
             f"and redone (kept runs with others over {args.idle_threshold} cores: *)", ""]
    for key in ("none_over_llamacpp_b1", "default_over_llamacpp_b1"):
        if data[key] is not None:
            lines.append(f"- `{key}` (batch 1, {top} threads): **{data[key]:.2f}x** (best: "
                         f"`{data[key + '_engine']}`)")
    lines += ["", "| engine | threads | batch | tokens/s (median) | runs | / transformers | "
              "/ llama.cpp | greedy agreement with transformers |",
              "|---|---|---|---|---|---|---|---|"]
    for (n, t, b), v in runs.items():
        ratios = [f"{med[n, t, b] / med[ref, t, b]:.2f}x" if (ref, t, b) in med and n != ref
                  else "" for ref in (REFERENCE, "llama.cpp")]
        note = "(reference)" if n == REFERENCE else agreement(
            outputs[n, t, b], outputs[REFERENCE, t, b], eos, args.max_new_tokens) if (
            REFERENCE, t, b) in outputs else ""
        cells = ", ".join(f"{r:.1f}" + ("*" if f > args.idle_threshold else "") for r, f in v)
        lines.append(f"| {n} | {t} | {b} | {med[n, t, b]:.1f} | {cells} | {ratios[0]} | "
                     f"{ratios[1]} | {note} |")
    lines += ["", f"Resident memory loading each engine adds in a fresh process (GGUF "
              f"{gguf / 2**20:.1f} MiB):", "", "| engine | RSS growth MiB | / GGUF | after "
              "malloc_trim MiB | / GGUF | KV cache MiB |", "|---|---|---|---|---|---|"]
    lines += [f"| {n} | {m['rss_growth'] / 2**20:.1f} | {m['over_gguf']:.2f} | "
              f"{m['rss_growth_trimmed'] / 2**20:.1f} | {m['trimmed_over_gguf']:.2f} | " + (
                  "n/a" if m["kv_cache_bytes"] is None else f"{m['kv_cache_bytes'] / 2**20:.1f}")
              + " |" for n, m in memory.items()]
    return data, lines + [""]


class Weight:
    """One weight in every format, from random 4-bit codes with Q4_1's block scales and mins
    (so that int4 holds it exactly)."""

    def __init__(self, n: int, k: int, gen: torch.Generator) -> None:
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
        d = torch.rand(n, k // GROUP, generator=gen) * 0.02
        m = -torch.rand(n, k // GROUP, generator=gen) * 0.15
        self.fp32 = (q.view(n, -1, GROUP) * d[..., None] + m[..., None]).view(n, k)
        self.bf16 = self.fp32.bfloat16()
        self.int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        zeros = m + 8 * d  # torch's int4 dequantization: (code - 8) * scale + zero
        self.int4_sz = torch.stack([d, zeros], -1).transpose(0, 1).contiguous()
        self.int4_sz_bf16 = self.int4_sz.bfloat16()
        scale = self.fp32.abs().amax(1) / 127
        self.int8 = (self.fp32 / scale[:, None]).round().to(torch.int8)
        self.int8_scale = scale.bfloat16()


FORMATS = {  # name: (x, weight -> y), bytes per weight
    "float32": (lambda x, w: F.linear(x, w.fp32), 4.0),
    "bfloat16": (lambda x, w: F.linear(x.bfloat16(), w.bf16), 2.0),
    "int4, float32 activations": (lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, w.int4, GROUP, w.int4_sz), 0.5 + 8 / GROUP),
    "int4, bfloat16 activations": (lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.bfloat16(), w.int4, GROUP, w.int4_sz_bf16), 0.5 + 4 / GROUP),
    "int8 per row, bfloat16 activations": (lambda x, w: torch.ops.aten._weight_int8pack_mm(
        x.bfloat16(), w.int8, w.int8_scale), 1.0),
}


def kernels(args) -> tuple[dict, list[str]]:
    gen = torch.Generator().manual_seed(0)
    layers = [[Weight(n, k, gen) for n, k in LAYER] for _ in range(args.layers)]
    head = Weight(VOCAB, HIDDEN, gen)
    params = sum(n * k for n, k in LAYER) * args.layers + VOCAB * HIDDEN
    rows = []
    for threads in sorted({1, num_cores()}):
        torch.set_num_threads(threads)
        for n in args.rows:
            x, x_inter = torch.randn(n, HIDDEN), torch.randn(n, INTER)

            def one_pass(fmt, x=x, x_inter=x_inter) -> float:
                return wall_s(lambda: [fmt(x_inter if k == INTER else x, w) for layer in layers
                                       for (_, k), w in zip(LAYER, layer)] + [fmt(x, head)])[0]
            for name, (fmt, bytes_per) in FORMATS.items():
                one_pass(fmt)  # warm-up
                ref = F.linear(x, layers[0][2].fp32)
                err = (fmt(x, layers[0][2]).float() - ref).abs().max() / ref.abs().max()
                rows.append({"threads": threads, "rows": n, "format": name,
                             "ms": min(one_pass(fmt) for _ in range(args.repeats)) * 1e3,
                             "weight_mb": params * bytes_per / 1e6, "max_rel_error": float(err)})
    same = {(b["threads"], b["rows"], b["format"]): b["ms"] for b in rows}
    for r in rows:
        r["speedup_over_float32"] = same[r["threads"], r["rows"], "float32"] / r["ms"]
        r["over_fewest_rows"] = r["ms"] / same[r["threads"], min(args.rows), r["format"]]
    lines = ["## One token's matmuls per weight format", "", f"{args.layers} layers and the "
             f"tied LM head ({params / 1e6:.0f}M weights); best of {args.repeats} passes.", "",
             "| threads | rows | format | weights MB | ms per pass | over float32 | "
             f"over {min(args.rows)} row(s) | max rel. error |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['threads']} | {r['rows']} | {r['format']} | {r['weight_mb']:.0f} | "
              f"{r['ms']:.1f} | {r['speedup_over_float32']:.2f} | {r['over_fewest_rows']:.2f} | "
              f"{r['max_rel_error']:.1e} |" for r in rows]
    return {"rows": rows}, lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="decode", help="decode, kernels or both")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", type=int_list, default=[1, 4], help="each dividing 8")
    ap.add_argument("--threads", type=int_list, default=None, help="default: 1 and nproc")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"a subset of {ENGINES}")
    ap.add_argument("--prefix-caching", action="store_true", help="flashtree's (off: the "
                    "other engines prefill every prompt in full)")
    ap.add_argument("--llamacpp-note", help="how llama-cpp-python was built, for the report")
    ap.add_argument("--idle-threshold", type=float, default=0.25)
    ap.add_argument("--idle-timeout", type=float, default=600.0)
    ap.add_argument("--max-retries", type=int, default=3)
    ap.add_argument("--rows", type=int_list, default=[1, 4, 16], help="kernels: token rows")
    ap.add_argument("--layers", type=int, default=LAYERS, help="kernels: decoder layers")
    ap.add_argument("--out", type=Path,
                    default=Path("benchmarks/results") / f"{datetime.date.today()}-cpu.md")
    ap.add_argument("--probe", choices=[*FLASHTREE_ENGINES, "llama.cpp"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:  # internal: one engine's memory, in a fresh process
        print(json.dumps(probe(args.probe)))
        return 0
    args.threads = args.threads or int_list(f"1,{num_cores()}")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if any(b < 1 or len(PROMPTS) % b for b in args.batch_sizes):
        ap.error(f"--batch-sizes must divide {len(PROMPTS)}, got {args.batch_sizes}")
    if unknown := [e for e in args.engines if e not in ENGINES]:
        ap.error(f"--engines: unknown {unknown}")
    import transformers

    data: dict = {"cpu": cpu_model(), "nproc": num_cores(), "threads": args.threads,
                  "batch_sizes": args.batch_sizes, "max_new_tokens": args.max_new_tokens,
                  "repeats": args.repeats, "transformers": transformers.__version__}
    lines = []
    for section, run in (("decode", decode), ("kernels", kernels)):
        if section in args.sections.split(","):
            got, text = run(args)
            data.update(got if section == "decode" else {"kernels": got})
            lines += text
    write_results(args.out, "The CPU against llama.cpp (default model, SmolLM2-135M)", lines,
                  data, ("none_over_llamacpp_b1", "default_over_llamacpp_b1",
                         "weights_rss_over_gguf") if "decode" in args.sections else ())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
