"""Compile every Triton kernel ahead of time for a GPU architecture, on any host: no GPU is
needed (ptxas ships with triton), and register, shared-memory and layout errors the CPU
interpreter cannot see show here.

    python -m fusedserve.kernels.triton.aot_check [--arch 90]

Run it outside ``TRITON_INTERPRET``. Every variant the runtime launches is compiled: the
decode split kernel for each GQA group from 1 to 16 (Qwen3's run 1-8, the 235B 16) at the
key tile the runtime picks for it, the prompt kernel at its runtime tiles (16x16), in bf16 and
in float32 with IEEE products.
Prints one line per variant: cubin size, shared memory, registers and spill bytes (ptxas -v on
the same PTX); exits 1 if any variant spills registers to local memory.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from fusedserve.kernels.triton import decode_attention as attn
from fusedserve.kernels.triton import layer_kernels as k
from fusedserve.kernels.triton import lora
from fusedserve.kernels.triton import prompt_attention as prompt
from fusedserve.kernels.triton import sampler as samp

P16, I32, F32 = "*bf16", "i32", "fp32"
C = "constexpr"


def _split(group: int) -> tuple:
    """The decode split kernel for a GQA ``group`` (8 KV heads, head_dim 128), tiled as the
    runtime tiles it."""
    group_p = max(1 << (group - 1).bit_length(), 2)
    return (attn._split_kernel,
            dict(q_ptr=P16, k_ptr=P16, v_ptr=P16, tables_ptr="*i32", lens_ptr="*i32", m_ptr="*fp32",
                 l_ptr="*fp32", acc_ptr="*fp32", scale=F32, stride_qb=I32, stride_qh=I32, stride_slot=I32,
                 stride_kvh=I32, stride_tb=I32, GROUP=C, GROUP_P=C, HD=C, BLOCK_N=C, BS=C,
                 SPLITS=C, NH=C),
            {"GROUP": group, "GROUP_P": group_p, "HD": 128, "BLOCK_N": attn.split_block_n(group_p),
             "BS": 16, "SPLITS": 8, "NH": 8 * group})


def _prompt(tile: int, f32: bool) -> tuple:
    """The prompt kernel at ``tile`` x ``tile``, 16-bit or float32 (IEEE products)."""
    ptr = "*fp32" if f32 else P16
    return (prompt._prompt_kernel,
            dict(q_ptr=ptr, k_ptr=ptr, v_ptr=ptr, out_ptr=ptr, qsl_ptr="*i32", lens_ptr="*i32",
                 tables_ptr="*i32", scale=F32, first_row=I32, stride_qt=I32, stride_qh=I32, stride_ot=I32,
                 stride_oh=I32, stride_slot=I32, stride_kvh=I32, stride_tb=I32, GROUP=C, HD=C, BS=C,
                 BLOCK_M=C, BLOCK_N=C, DOT_F32=C, PRECISION=C),
            {"GROUP": 4, "HD": 128, "BS": 16, "BLOCK_M": tile, "BLOCK_N": tile, "DOT_F32": False,
             "PRECISION": "ieee" if f32 else "tf32"})


def jobs() -> dict[str, tuple]:
    """Each kernel variant with a signature and the constants of a Qwen3-shaped launch."""
    out = {
        "add_rms_norm": (k._add_rms_norm_kernel,
                         dict(x_ptr=P16, add_ptr=P16, w_ptr=P16, out_ptr=P16, D=I32, stride_x=I32,
                              stride_a=I32, stride_o=I32, eps=F32, HAS_ADD=C, BLOCK=C),
                         {"HAS_ADD": True, "BLOCK": 4096}),
        "qk_norm_rope": (k._qk_norm_rope_kernel,
                         dict(qkv_ptr=P16, qw_ptr=P16, kw_ptr=P16, cos_ptr=P16, sin_ptr=P16,
                              q_out_ptr=P16, k_cache_ptr=P16, v_cache_ptr=P16, slot_ptr="*i64",
                              stride_qkv=I32, stride_cs=I32, stride_q=I32, stride_slot=I32, eps=F32,
                              NH=C, NKV=C, HD=C, HALF=C),
                         {"NH": 32, "NKV": 8, "HD": 128, "HALF": 64}),
        "silu_mul": (k._silu_mul_kernel,
                     dict(gu_ptr=P16, out_ptr=P16, N=I32, stride_gu=I32, stride_o=I32, BLOCK=C),
                     {"BLOCK": 1024}),
        "decode_attention_merge": (
            attn._merge_kernel,
            dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr=P16, stride_ob=I32, stride_oh=I32,
                 NH=C, SPLITS=C, SPLITS_P=C, HD=C),
            {"NH": 32, "SPLITS": 8, "SPLITS_P": 8, "HD": 128}),
        "token_bitmask": (k._token_bitmask_kernel,
                          dict(logits_ptr="*fp32", mask_ptr="*i32", V=I32, W=I32, stride_l=I32, BLOCK=C),
                          {"BLOCK": 4096}),
    }
    for group in range(1, 17):
        out[f"decode_attention_split_gqa{group}"] = _split(group)
    out["prompt_attention_16x16_bf16"] = _prompt(16, False)  # the runtime's tiles
    out["prompt_attention_16x16_fp32_ieee"] = _prompt(16, True)
    out.update(_sampler())
    out.update(_lora())
    return out


def _lora() -> dict[str, tuple]:
    """The LoRA kernels at rank 16 (bf16, Qwen3-0.6B's widest projection: K 3072, N 6144)."""
    ranks = {"R": 16, "R_P": 16}
    return {
        "lora_shrink": (lora._shrink_kernel,
                        dict(x_ptr=P16, a_ptr=P16, u_ptr="*fp32", slots_ptr="*i32", active_ptr="*u8", K=I32,
                             stride_x=I32, stride_as=I32, stride_u=I32, R=C, R_P=C, BLOCK_K=C),
                        {**ranks, "BLOCK_K": lora.BLOCK_K}),
        "lora_expand": (lora._expand_kernel,
                        dict(y_ptr=P16, bt_ptr=P16, u_ptr="*fp32", slots_ptr="*i32", active_ptr="*u8",
                             N=I32, P1=I32, P2=I32, stride_y=I32, stride_bs=I32, stride_u=I32, R=C, R_P=C,
                             BLOCK_N=C),
                        {**ranks, "BLOCK_N": lora.BLOCK_N}),
    }


def _sampler() -> dict[str, tuple]:
    """The sampler's kernels at Qwen3's vocabulary (151,936: 149 tiles) and 64 candidates."""
    f32, i64 = "*fp32", "*i64"
    common = dict(logits_ptr=f32, params_ptr=f32, topv_ptr=f32, kth_ptr=i64)
    ints = dict(V=I32, stride_l=I32, n=I32, NC=I32)
    tiles = {"NC_P": 256, "BLOCK": samp.BLOCK}
    out = {}
    for weights in (False, True):
        out[f"sampler_sum_{'weights' if weights else 'exp'}"] = (
            samp._sum_kernel, dict(**common, sums_ptr=f32, part_ptr=i64 if weights else f32, **ints,
                                   WEIGHTS=C, NC_P=C, BLOCK=C), {"WEIGHTS": weights, **tiles})
    for cut in (False, True):
        name = "cut" if cut else "kth"
        for rnd in (0, 3):  # the first round, and the last (three earlier rounds re-derived)
            out[f"sampler_select_{name}_round{rnd}"] = (
                samp._select_hist_kernel,
                dict(**common, cut_ptr=i64, target_ptr=i64, sums_ptr=f32, hist_ptr=i64, **ints, B=I32,
                     ROUND=C, CUT=C, NC_P=C, BLOCK=C, SUB=C),
                {"ROUND": rnd, "CUT": cut, "SUB": 32, **tiles})
        out[f"sampler_select_{name}_done"] = (
            samp._select_done_kernel,
            dict(params_ptr=f32, kth_ptr=i64, cut_ptr=i64, target_ptr=i64, hist_ptr=i64, V=I32, n=I32,
                 B=I32, CUT=C), {"CUT": cut})
    out["sampler_row"] = (
        samp._row_kernel, dict(params_ptr=f32, seeds_ptr=i64, topv_ptr=f32, topi_ptr=i64, kth_ptr=i64,
                               cut_ptr=i64, target_ptr=i64, sums_ptr=f32, weights_ptr=i64, out_ptr="*i32",
                               V=I32, n=I32, NC=I32, TOP_P=C, N_P=C, NC_P=C),
        {"TOP_P": True, "N_P": 64, "NC_P": 256})
    out["sampler_draw_mass"] = (
        samp._draw_mass_kernel, dict(**common, cut_ptr=i64, sums_ptr=f32, mass_ptr="*fp64", **ints, NC_P=C,
                                     BLOCK=C), tiles)
    out["sampler_draw"] = (
        samp._draw_kernel, dict(logits_ptr=f32, params_ptr=f32, seeds_ptr=i64, topv_ptr=f32, kth_ptr=i64,
                                cut_ptr=i64, sums_ptr=f32, mass_ptr="*fp64", out_ptr="*i32", **ints,
                                NC_P=C, BLOCK=C), tiles)
    return out


_USAGE = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas(arch: int) -> str:
    """The ptxas Triton compiles with (its API moved between 3.6 and 3.9)."""
    from triton.backends.nvidia import compiler

    try:
        return compiler.get_ptxas(arch).path
    except TypeError:
        return compiler.get_ptxas().path


def resources(ptx: str, arch: int) -> dict[str, int]:
    """Registers and spill bytes of ``ptx`` as ptxas reports them (-v), with the flags Triton
    builds its cubins with."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([_ptxas(arch), "-v", "--regAllocOptLevel=2",
                              f"--gpu-name=sm_{arch}{'a' if arch >= 90 else ''}", str(src), "-o",
                              str(Path(tmp) / "k.o")], capture_output=True, text=True, check=True)
    regs = [int(m) for m in _USAGE.findall(run.stderr)]
    spills = [int(a) + int(b) for a, b in _SPILL.findall(run.stderr)]
    return {"registers": max(regs, default=0), "spill_bytes": sum(spills)}


def compile_job(job: tuple, arch: int = 90):
    """One ``(kernel, signature, constants)`` compiled for ``sm_<arch>`` (its ``asm`` holds the
    TTIR, PTX and cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, signature, constants = job
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                          target=GPUTarget("cuda", arch, 32))


def compile_all(arch: int = 90) -> dict[str, dict]:
    out = {}
    for name, job in jobs().items():
        compiled = compile_job(job, arch)
        out[name] = {"cubin_bytes": len(compiled.asm["cubin"]), "shared": compiled.metadata.shared,
                     **resources(compiled.asm["ptx"], arch)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args(argv)
    spilled = []
    for name, info in compile_all(args.arch).items():
        print(f"{name}: cubin {info['cubin_bytes']} bytes, shared memory {info['shared']} bytes, "
              f"{info['registers']} registers, {info['spill_bytes']} spill bytes", flush=True)
        if info["spill_bytes"]:
            spilled.append(name)
    if spilled:
        print(f"spills registers to local memory: {', '.join(spilled)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
