"""The Triton kernels compile for an H200 (sm_90) without one: through triton's front end, its
passes and its bundled ptxas, in the configurations the engine launches. The interpreter runs
Python, so it misses what only the compiler rejects (a branch's code type-checked after an
early return once cost a GPU session). The PTX also shows whether a tile reaches Hopper's
warpgroup MMA (wgmma), which MLA's compute-bound latent tile is shaped for; the streaming
kernels (GEMV, fused norm/RoPE/SiLU) compile without spilling registers. The compiles run in a
child process (the test session runs triton's interpreter, which replaces the kernels); skipped
where triton (a failure under CI=true) or its ptxas is not installed, and where CUDA exists
(tests/gpu/ runs the kernels themselves)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.layers.needs_triton import TRITON_MISSING

ROOT = Path(__file__).resolve().parents[2]
STREAMING = ["gemv", "gemv:rows", "gemv:normed"] + [f"fused:{k}" for k in (
    "rms_norm", "rms_norm_residual", "silu_mul", "norm_rope", "norm_rope_to_cache",
    "mla_prologue")]
PAIR_GEMVS = ["moe:pair_gate_up_kernel:int4", "moe:token_down_kernel:int4",
              "moe:token_down_kernel:int4-ep", "moe:pair_gate_up_kernel:int4-split"]
STREAMING += PAIR_GEMVS
PDL_KERNELS = ["gemv", "fused:rms_norm", "fused:rms_norm_residual", "fused:silu_mul",
               "router:kimi", "router:deepseek", "moe:_split_activation_kernel:bf16",
               "fused:mla_prologue", "merge:all-rows", "merge:written-rows", "attention:mla",
               "attention:mla-rank", *PAIR_GEMVS]
CASES = [f"moe:{k}:{w}" for k in ("_gate_up_kernel", "_down_kernel")
         for w in ("bf16", "int4", "fp8", "bf16-per-pair")] + [
    "moe:_gate_up_kernel:int4-split", "moe:_split_activation_kernel:bf16", "grouping",
    "moe:_gate_up_kernel:int4-packed", "moe:_down_kernel:int4-packed",
    "moe:_gate_up_kernel:int4-packed-split",
    "merge:all-rows", "merge:written-rows",
    "router:kimi", "router:deepseek", "attention:dense", "attention:mla",
    "attention:mla-rank", "ddtree:63", "ddtree:511", *STREAMING]


@pytest.fixture(scope="module")
def reports() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip(TRITON_MISSING)
    if torch.cuda.is_available():
        pytest.skip("CUDA present: tests/gpu/ runs the kernels themselves")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, cwd=ROOT,
                         env={**env, "PYTHONPATH": str(ROOT)}, timeout=600)
    if run.returncode == 3:
        pytest.skip("triton ships no ptxas here")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_kernel_compiles_for_sm90(reports, case):
    assert reports[case]["compiled"], reports[case]
    if case == "attention:mla":
        assert reports[case]["wgmma"] > 0, reports[case]
    if case == "attention:dense":  # 16-row tiles: their dots on the tensor cores, warp MMA
        assert reports[case]["mma"] > 0, reports[case]
    if case == "gemv:rows":  # tensor cores: a float32 dot on the FMA units ran at 0.3 TB/s
        assert reports[case]["mma"] > 0, reports[case]
    if case in PDL_KERNELS:  # launched with PDL on Hopper: each waits for the one before
        assert reports[case]["gdc_waits"] > 0, reports[case]
    if case in STREAMING:  # a spill in a bandwidth-bound kernel adds memory traffic per element
        assert reports[case]["spill_bytes"] == 0, reports[case]


FLOATS = ("sm_scale_log2", "eps", "scaling")  # the kernels' float scalar arguments


def compile_sm90(fn, constants: dict, pointers: dict[str, str], tmp_path: Path,
                 num_warps: int = 4, multiples_of_16: tuple[str, ...] = ()) -> dict:
    """Compile `fn` (a @triton.jit kernel) for sm_90 -> {"compiled", "registers",
    "spill_bytes", "wgmma" (warpgroup MMA instructions in the PTX), "mma" (warp MMAs)}.
    `pointers`: the element type of each pointer argument; other arguments are i32 but those
    in FLOATS (fp32). As a launch specializes them: pointers are 16-byte aligned and the
    integers named in `multiples_of_16` divisible by 16."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({"num_warps": num_warps})
    signature = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    names = list(inspect.signature(fn.fn).parameters)
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names
               if n in pointers or n in multiples_of_16}
    source = ASTSource(fn, signature, constants, aligned)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(target, options, backend.get_codegen_implementation(options),
                            backend.get_module_map(), context)
    stages: dict = {}
    backend.add_stages(stages, options, source.language)
    metadata: dict = {}
    for stage in ("ttir", "ttgir", "llir", "ptx"):
        module = stages[stage](module, metadata)
    ptx = tmp_path / "kernel.ptx"
    ptx.write_text(module)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    report = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", str(ptx), "-o",
                             str(tmp_path / "kernel.cubin")], capture_output=True, text=True)
    if report.returncode:
        return {"compiled": False, "ptxas": report.stderr[-2000:]}
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report.stderr))
    registers = int(re.search(r"Used (\d+) registers", report.stderr).group(1))
    return {"compiled": True, "registers": registers, "spill_bytes": spills,
            "wgmma": module.count("wgmma.mma_async"), "mma": module.count("mma.sync"),
            "gdc_waits": module.count("griddepcontrol.wait")}


def moe_case(kernel: str, weights: str, tmp_path: Path) -> dict:
    """A grouped GEMM with its default tiles for bf16, INT4 (group 32) or FP8 experts, over
    blocks of grouped pairs, (`-per-pair`) a block per pair or (`-split`) a split input dim,
    INT4 (`-packed`) unpacked by `int4_unpack`'s PTX; or (`pair_*`, `token_*`) an INT4 GEMV
    per pair or per token."""
    from flashtree.layers import fused_moe, moe_gemv
    from flashtree.layers.stacked_experts import StackedExperts

    if kernel == "_split_activation_kernel":
        return compile_sm90(fused_moe._split_activation_kernel, dict(BLOCK=256, PDL=True),
                            dict(part_ptr="fp32", act_ptr="bf16"), tmp_path)
    weights, variant = weights.partition("-")[::2]
    group, fp8 = {"bf16": (0, None), "int4": (32, None), "fp8": (0, (128, 128))}[weights]
    dummy = torch.empty(1, 2, 8)
    bo, bi = fp8 or (0, 0)
    packed = variant.startswith("packed")
    variant = variant.removeprefix("packed").removeprefix("-")
    split = variant == "split"
    if kernel.startswith(("pair_", "token_")):
        pair = fused_moe.PairTiles()
        down = kernel == "token_down_kernel"
        constants = dict(GROUP=group, BLOCK_N=pair.down_block_n if down else pair.block_n,
                         BLOCK_K=pair.down_block_k if down else pair.block_k, PDL=True)
        if down:  # Kimi's and Qwen3-MoE's top_k; expert parallel: a slot a tile, 8x the rows
            ep = variant == "ep"
            constants.update(HAS_SHARED=True, TOP_K=8, SLOTS=1 if ep else 8, EVEN_K=True,
                             BLOCK_N=pair.down_block_n * (8 if ep else 1))
        num_warps, module = pair.num_warps, moe_gemv
    else:
        tiles = fused_moe.default_tiles(StackedExperts(dummy, dummy, group=group, fp8_block=fp8))
        constants = dict(BLOCK_M=16, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP=group,
                         BO=bo, BI=bi, PER_PAIR=variant == "per-pair", PRECISION="tf32",
                         PACKED_UNPACK=packed)
        num_warps, module = tiles.num_warps, fused_moe
    if "gate_up" in kernel:
        constants["SPLIT"] = split
    weight_type = {"bf16": "bf16", "int4": "i32", "fp8": "fp8e4nv"}[weights]
    pointers = dict(x_ptr="bf16", act_ptr="bf16", out_ptr="fp32" if split else "bf16",
                    w_ptr=weight_type, s_ptr="bf16" if weights == "int4" else "fp32",
                    weights_ptr="fp32", pairs_ptr="i32", experts_ptr="i32",
                    ids_ptr="i64", shared_ptr="bf16")
    return compile_sm90(getattr(module, kernel), constants, pointers, tmp_path, num_warps)


def grouping_case(tmp_path: Path) -> dict:
    from flashtree.layers.moe_align import _align_kernel

    return compile_sm90(_align_kernel, dict(BLOCK_M=16, E_PAD=512, CHUNK=1024, BLOCKS_PER_STEP=8),
                 dict(local_ptr="i64", pairs_ptr="i64", blocks_ptr="i64", starts_ptr="i64",
                      cursor_ptr="i64"), tmp_path, 8)


def merge_case(written_rows_only: bool, tmp_path: Path) -> dict:
    """The context splits' merge as GQA decode (all rows written) and MLA (real rows only)."""
    from flashtree.attention.triton_common import _merge_splits_kernel

    constants = dict(GROUP=8, HEAD_DIM=512, BLOCK_D=512, BLOCK_DC=64, BLOCK_M=64, NUM_SPLITS=4,
                     BLOCK_SPLITS=4, WRITTEN_ROWS_ONLY=written_rows_only, PDL=True)
    return compile_sm90(_merge_splits_kernel, constants,
                        dict(out_ptr="bf16", part_acc_ptr="fp32", part_m_ptr="fp32",
                             part_l_ptr="fp32", query_start_ptr="i64"), tmp_path)


def router_case(model: str, tmp_path: Path) -> dict:
    """The fused router at Kimi K2.6's shape (384 sigmoid experts with the correction bias, no
    groups, top 8) or DeepSeek-V3's (256 experts in 8 groups, the 4 best kept, top 8)."""
    from flashtree.layers.moe_router import _route_kernel

    groups = dict(kimi=(1, 1), deepseek=(8, 4))[model]
    constants = dict(E_PAD=512 if model == "kimi" else 256, TOP_K=8, K_PAD=8, SOFTMAX=False,
                     HAS_BIAS=True, N_GROUP=groups[0], G_PAD=groups[0], TOPK_GROUP=groups[1],
                     GROUP_TOP2=True, RENORM=True, PDL=True)
    return compile_sm90(_route_kernel, constants,
                        dict(logits_ptr="fp32", bias_ptr="fp32", weights_ptr="fp32",
                             ids_ptr="i64"), tmp_path, 4, ("num_experts", "stride_t"))


def attention_case(kind: str, tmp_path: Path) -> dict:
    """The paged-attention kernel as dense GQA heads launch it (`dense`), or the latent kernel
    with DeepSeek-V3's 128 heads over 512 + 64 columns (`mla`) or a Kimi TP8 rank's 8
    (`mla-rank`)."""
    from flashtree.attention.triton import _paged_attention_kernel
    from flashtree.attention.triton_mla import latent_attention_kernel, latent_tile

    constants = dict(PAGE=16, NUM_SPLITS=4, HAS_MASK=True, CAUSAL=True, PRECISION="tf32")
    pointers = dict(q_ptr="bf16", out_ptr="bf16", part_acc_ptr="fp32", part_m_ptr="fp32",
                    part_l_ptr="fp32", page_tables_ptr="i64", kv_lens_ptr="i64",
                    query_start_ptr="i64", mask_ptr="u8")
    strides = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_ks")
    if kind != "dense":
        heads = 8 if kind == "mla-rank" else 128
        tile = latent_tile(512, heads)
        num_warps = tile.pop("num_warps")
        tile.pop("num_stages")
        return compile_sm90(latent_attention_kernel,
                            dict(constants, HEADS=heads, HALF=256, TAIL=64, BLOCK_TAIL=64,
                                 PDL=True, **tile),
                            dict(pointers, kv_ptr="bf16"), tmp_path, num_warps, strides)
    constants.update(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=16, BLOCK_N=32,
                     HAS_WINDOW=False)
    return compile_sm90(_paged_attention_kernel, constants,
                        dict(pointers, k_ptr="bf16", v_ptr="bf16"), tmp_path, 4,
                        strides + ("stride_kh", "stride_vs", "stride_vh"))


def gemv_case(variant: str, tmp_path: Path) -> dict:
    """The batch-1 GEMV as `layers/gemv.py` launches it on bf16 weights whose K and row stride
    are multiples of 16 (every projection of the models served); `normed` with an RMSNorm
    before it (MLA's q_a norm before q_b); `rows`, `gemv_rows` on a float32 router."""
    from flashtree.layers import gemv

    if variant == "rows":
        return compile_sm90(gemv._gemv_rows_kernel,
                            dict(ROWS=16, BLOCK_N=gemv._ROWS_BLOCK_N, BLOCK_K=gemv._ROWS_BLOCK_K),
                            dict(x_ptr="bf16", w_ptr="fp32", part_ptr="fp32"), tmp_path, 4,
                            ("k", "k_per_split", "stride_x", "stride_w"))
    return compile_sm90(gemv._gemv_kernel,
                        dict(BLOCK_N=gemv._BLOCK_N, BLOCK_K=gemv._BLOCK_K,
                             NORM=variant == "normed", PDL=True),
                        dict(x_ptr="bf16", w_ptr="bf16", y_ptr="bf16", g_ptr="bf16"), tmp_path,
                        gemv._WARPS, ("k", "stride_w"))


def fused_case(kernel: str, tmp_path: Path) -> dict:
    """`layers/fused.py`'s kernels as an 8B model (hidden 4096, MLP 12288, head_dim 128)
    launches them in bf16, with their default 4 warps: RMSNorm with or without the residual
    add, SiLU-and-multiply, and the per-head norm + RoPE to an output or into the KV cache."""
    from flashtree.layers import fused

    if kernel.startswith("rms_norm"):
        strides = ("stride_xt", "stride_rt", "stride_ot", "stride_st", "dim")
        return compile_sm90(fused._rms_norm_kernel,
                            dict(HAS_RESIDUAL=kernel.endswith("residual"), BLOCK=4096, PDL=True),
                            dict.fromkeys(("x_ptr", "res_ptr", "w_ptr", "out_ptr", "sum_ptr"),
                                          "bf16"), tmp_path, 4, strides)
    if kernel == "mla_prologue":  # a Kimi K2.6 rank's: latent 512, rope 64, interleaved
        from flashtree.layers import fused_mla

        pointers = dict.fromkeys(("q_lat_ptr", "q_pe_ptr", "kv_a_ptr", "w_ptr", "q_out_ptr",
                                  "cache_ptr"), "bf16")
        pointers.update(cos_ptr="fp32", sin_ptr="fp32", slots_ptr="i64")
        return compile_sm90(fused_mla._mla_prologue_kernel,
                            dict(INTERLEAVED=True, BLOCK_LATENT=512, BLOCK_HALF=32, PDL=True),
                            pointers,
                            tmp_path, 4, ("stride_lt", "stride_pt", "stride_ph", "stride_kt",
                                          "stride_ct", "stride_ot", "stride_oh", "stride_cs",
                                          "latent", "half"))
    if kernel == "silu_mul":
        return compile_sm90(fused._silu_mul_kernel, dict(BLOCK=1024, PDL=True),
                            dict(x_ptr="bf16", out_ptr="bf16"), tmp_path, 4,
                            ("stride_xt", "stride_ot", "inter"))
    to_slots = kernel == "norm_rope_to_cache"
    pointers = dict.fromkeys(("x_ptr", "w_ptr", "out_ptr", "slots_ptr", "v_ptr", "v_out_ptr"),
                             "bf16")  # without slots the launch passes x and out for them
    pointers.update(cos_ptr="fp32", sin_ptr="fp32", slots_ptr="i64" if to_slots else "bf16")
    return compile_sm90(fused._norm_rope_kernel,
                        dict(HAS_NORM=True, TO_SLOTS=to_slots, BLOCK=64, V_BLOCK=128), pointers,
                        tmp_path, 4, ("stride_xt", "stride_xh", "stride_ct", "stride_ot",
                                      "stride_oh", "stride_vt", "stride_vh", "stride_vot",
                                      "stride_voh", "half", "v_dim"))


def ddtree_case(budget: int, tmp_path: Path) -> dict:
    """The one-launch DDTree build at the engine's shape: 15 depths, the top 16 tokens."""
    from flashtree.speculative import tree_kernel

    pointers = dict(lp_ptr="fp32", tok_ptr="i64", roots_ptr="i64", keys_ptr="fp32",
                    flat_ptr="i32", order_ptr="i64", up_ptr="i32", nodes_ptr="i64",
                    visible_ptr="u8")
    return compile_sm90(tree_kernel._tree_kernel, tree_kernel.launch_sizes(15, 16, budget),
                        pointers, tmp_path, tree_kernel.num_warps(budget))


def main() -> None:
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        sys.exit(3)
    out = {}
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            kind, *rest = case.split(":")
            if kind == "moe":
                out[case] = moe_case(rest[0], rest[1], Path(tmp))
            elif kind == "grouping":
                out[case] = grouping_case(Path(tmp))
            elif kind == "merge":
                out[case] = merge_case(rest[0] == "written-rows", Path(tmp))
            elif kind == "router":
                out[case] = router_case(rest[0], Path(tmp))
            elif kind == "gemv":
                out[case] = gemv_case(rest[0] if rest else "", Path(tmp))
            elif kind == "fused":
                out[case] = fused_case(rest[0], Path(tmp))
            elif kind == "ddtree":
                out[case] = ddtree_case(int(rest[0]), Path(tmp))
            else:
                out[case] = attention_case(rest[0], Path(tmp))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
