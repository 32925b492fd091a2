"""Compile every Triton kernel ahead of time for a GPU architecture, on any host: no GPU is
needed (ptxas ships with triton), and register, shared-memory and layout errors the CPU
interpreter cannot see show here.

    python -m kernels.triton.aot_check [--arch 90]

Run it outside ``TRITON_INTERPRET``. Prints one line per kernel: its cubin's size and its
shared memory.
"""

from __future__ import annotations

import argparse

from kernels.triton import decode_attention as attn
from kernels.triton import layer_kernels as k
from kernels.triton import prompt_attention as prompt

P16, I32, F32 = "*bf16", "i32", "fp32"
C = "constexpr"


def jobs() -> dict[str, tuple]:
    """Each kernel with a signature and the constants of a Qwen3-8B-shaped launch."""
    return {
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
        "decode_attention_split": (
            attn._split_kernel,
            dict(q_ptr=P16, k_ptr=P16, v_ptr=P16, tables_ptr="*i32", lens_ptr="*i32", m_ptr="*fp32",
                 l_ptr="*fp32", acc_ptr="*fp32", scale=F32, stride_qb=I32, stride_qh=I32, stride_slot=I32,
                 stride_kvh=I32, stride_tb=I32, chunk=I32, GROUP=C, GROUP_P=C, HD=C, BLOCK_N=C, BS=C,
                 SPLITS=C, NH=C),
            {"GROUP": 4, "GROUP_P": 4, "HD": 128, "BLOCK_N": 16, "BS": 16, "SPLITS": 8, "NH": 32}),
        "decode_attention_merge": (
            attn._merge_kernel,
            dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr=P16, stride_ob=I32, stride_oh=I32,
                 NH=C, SPLITS=C, SPLITS_P=C, HD=C),
            {"NH": 32, "SPLITS": 8, "SPLITS_P": 8, "HD": 128}),
        "prompt_attention": (
            prompt._prompt_kernel,
            dict(q_ptr=P16, k_ptr=P16, v_ptr=P16, out_ptr=P16, qsl_ptr="*i32", lens_ptr="*i32",
                 tables_ptr="*i32", scale=F32, first_row=I32, stride_qt=I32, stride_qh=I32, stride_ot=I32,
                 stride_oh=I32, stride_slot=I32, stride_kvh=I32, stride_tb=I32, GROUP=C, HD=C, BS=C,
                 BLOCK_M=C, BLOCK_N=C, DOT_F32=C),
            {"GROUP": 4, "HD": 128, "BS": 16, "BLOCK_M": 64, "BLOCK_N": 64, "DOT_F32": False}),
        "token_bitmask": (k._token_bitmask_kernel,
                          dict(logits_ptr="*fp32", mask_ptr="*i32", V=I32, W=I32, stride_l=I32, BLOCK=C),
                          {"BLOCK": 4096}),
    }


def compile_all(arch: int = 90) -> dict[str, dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    out = {}
    for name, (fn, signature, constants) in jobs().items():
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants), target=target)
        out[name] = {"cubin_bytes": len(compiled.asm["cubin"]), "shared": compiled.metadata.shared}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args(argv)
    for name, info in compile_all(args.arch).items():
        print(f"{name}: cubin {info['cubin_bytes']} bytes, shared memory {info['shared']} bytes")


if __name__ == "__main__":
    main()
