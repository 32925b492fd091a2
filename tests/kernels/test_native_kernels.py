"""The native CPU kernels: linear (16-bit and int8 weights) and paged decode attention,
against float64 references, batch invariance bit for bit, every ISA build this CPU runs,
and the ATen fallback where no compiler exists."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fusedserve.kernels.native import build as native
from fusedserve.kernels.quantize import quantize_int8


def _isas() -> list[str]:
    """The CPU's best build, and every lower vector build it runs (AVX-512 without BF16, AVX2):
    each path gets tested where the CPU can run it."""
    try:
        best = native.chosen_isa()
    except native.NativeUnavailable:
        return []
    isas = [best]
    for lower in ("avx512", "avx2"):
        if best != lower and lower in native.ISA_FLAGS and native.ISA_FLAGS[lower][0] <= native.cpu_flags():
            isas.append(lower)
    return isas


def _module(isa: str):
    """The build for ``isa``; a build error fails the test (only a missing toolchain skips)."""
    return native.build(isa)


def _integer_isas() -> list[str]:
    """``_isas()`` and the builds that differ from them only in their int8 dot products (512-bit
    VNNI without BF16, 256-bit VNNI as AVX-VNNI or in its EVEX twin): for the integer GEMMs' tests."""
    isas = _isas()
    for extra in ("avx512vnni", "avxvnni", "avxvnni_evex"):
        if isas and extra not in isas and native.ISA_FLAGS[extra][0] <= native.cpu_flags():
            isas.append(extra)
    return isas


ISAS = (_isas() or ["none"]) if native.missing_toolchain() is None else ["none"]
INT_ISAS = (_integer_isas() or ["none"]) if ISAS != ["none"] else ["none"]
needs_native = pytest.mark.skipif(ISAS == ["none"], reason=f"no toolchain: {native.missing_toolchain()}")

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wkind", ["bf16", "f16", "int8"])
@pytest.mark.parametrize("act", ["bf16", "f32"])
def test_linear_matches_float64_reference(isa, wkind, act):
    m = _module(isa)
    g = torch.Generator().manual_seed(0)
    for rows, k, n in [(1, 64, 8), (5, 100, 13), (17, 256, 37), (4, 31, 4)]:  # tails in every dim
        x = torch.randn(rows, k, generator=g).to(DTYPES[act])
        w = torch.randn(n, k, generator=g) * 0.1
        if wkind == "int8":
            q, scale = quantize_int8(w)
            args, wref = (q, scale), q.double() * scale.double()[:, None]
        else:
            wq = w.to(DTYPES[wkind])
            args, wref = (wq, None), wq.double()
        out = torch.empty(rows, n, dtype=x.dtype)
        m.linear(x, *args, out)
        ref = x.double() @ wref.t()
        # fp32 accumulation, then one rounding to the output dtype.
        tol = 1e-5 * k if act == "f32" else 2 ** -7 * ref.abs().max().item() + 1e-3
        err = (out.double() - ref).abs().max().item()
        assert err <= tol, f"{isa} {wkind} {act} {rows}x{k}x{n}: error {err} > {tol}"


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wkind", ["bf16", "int8"])
def test_linear_rows_do_not_depend_on_the_batch(isa, wkind):
    """Each output row is bit-identical whether computed alone, in 5 rows or in 37."""
    m = _module(isa)
    g = torch.Generator().manual_seed(1)
    k, n = 200, 45
    x = torch.randn(37, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g) * 0.1
    args = quantize_int8(w) if wkind == "int8" else (w.bfloat16(), None)
    full = torch.empty(37, n, dtype=torch.bfloat16)
    m.linear(x, *args, full)
    for lo, hi in [(0, 1), (3, 8), (36, 37), (10, 14)]:
        part = torch.empty(hi - lo, n, dtype=torch.bfloat16)
        m.linear(x[lo:hi], *args, part)
        assert torch.equal(part, full[lo:hi]), f"rows {lo}:{hi} differ from the 37-row call"


def _paged(lens, bs, kvh, hd, dtype, g):
    nblocks = sum(-(-n // bs) for n in lens) + 3
    k_cache = torch.randn(nblocks * bs, kvh, hd, generator=g).to(dtype)
    v_cache = torch.randn(nblocks * bs, kvh, hd, generator=g).to(dtype)
    perm = torch.randperm(nblocks, generator=g).tolist()
    tables, at = [], 0
    for n in lens:  # scattered, unordered blocks
        nb = -(-n // bs)
        tables.append(perm[at : at + nb])
        at += nb
    bt = torch.zeros(len(lens), max(len(t) for t in tables) + 2, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    return k_cache, v_cache, tables, bt


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_in_place_equals_dense(isa, dtype):
    m = _module(isa)
    g = torch.Generator().manual_seed(2)
    h, kvh, hd, bs = 8, 2, 32, 4
    # one token, block tails, more than one softmax chunk, and past one work item's 512 tokens
    lens = [1, 5, 33, 70, 129, 512, 513, 1100]
    k_cache, v_cache, tables, bt = _paged(lens, bs, kvh, hd, dtype, g)
    q = torch.randn(len(lens), h, hd, generator=g).to(dtype)
    out = torch.empty_like(q)
    m.decode_attention(q, k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int32), bs, hd ** -0.5, out)
    for i, n in enumerate(lens):
        idx = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(n)])
        k = k_cache[idx].double().transpose(0, 1)
        v = v_cache[idx].double().transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i].double().unsqueeze(1), k, v, enable_gqa=True).squeeze(1)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i].double(), ref, atol=tol, rtol=tol)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_decode_attention_rows_do_not_depend_on_the_batch_or_the_threads(isa):
    """Long rows are split into work items by their own length only: a row's output is the same
    bits alone, in a batch, and on one thread or two."""
    m = _module(isa)
    g = torch.Generator().manual_seed(4)
    lens, bs = [1300, 7, 513, 2050], 16
    k_cache, v_cache, _, bt = _paged(lens, bs, 2, 64, torch.bfloat16, g)
    q = torch.randn(len(lens), 8, 64, generator=g).bfloat16()
    sl = torch.tensor(lens, dtype=torch.int32)
    full = torch.empty_like(q)
    m.decode_attention(q, k_cache, v_cache, bt, sl, bs, 0.125, full)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for i in range(len(lens)):
                row = slice(i, i + 1)
                alone = torch.empty_like(q[row])
                m.decode_attention(q[row], k_cache, v_cache, bt[row], sl[row], bs, 0.125, alone)
                assert torch.equal(alone, full[row]), (n, lens[i])
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_decode_attention_reads_only_each_rows_own_context():
    """Garbage past a row's length (and in other rows' blocks) never reaches its output."""
    m = _module(ISAS[0])
    g = torch.Generator().manual_seed(3)
    lens, bs = [6, 40], 4
    k_cache, v_cache, _, bt = _paged(lens, bs, 2, 16, torch.float32, g)
    q = torch.randn(2, 4, 16, generator=g)
    sl = torch.tensor(lens, dtype=torch.int32)
    a, b = torch.empty_like(q), torch.empty_like(q)
    m.decode_attention(q, k_cache, v_cache, bt, sl, bs, 0.25, a)
    used = {int(bt[i, p // bs]) * bs + p % bs for i, n in enumerate(lens) for p in range(n)}
    for s in range(k_cache.shape[0]):
        if s not in used:
            k_cache[s] = float("nan")
            v_cache[s] = float("nan")
    m.decode_attention(q, k_cache, v_cache, bt, sl, bs, 0.25, b)
    assert torch.equal(a, b)


def test_without_a_compiler_the_model_falls_back_to_aten_with_one_warning(tmp_path, hf_checkpoints):
    code = textwrap.dedent(f"""
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        from fusedserve.worker.model.qwen3 import Qwen3Model
        m = Qwen3Model.from_pretrained({str(hf_checkpoints["gqa2_untied"])!r}, dtype="bfloat16")
        Qwen3Model.from_pretrained({str(hf_checkpoints["gqa2_untied"])!r}, dtype="float32")
        print("KERNELS", m.kernel_info())
    """)
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "FUSEDSERVE_CPU_ISA": "",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "'linear': 'aten-mm'" in r.stdout and "'attention': 'aten-gather'" in r.stdout, r.stdout
    assert r.stderr.count("native CPU kernels unavailable") == 1, r.stderr


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_a_live_one_kept(tmp_path, caplog):
    """torch's build lock has no owner: a process killed mid-build leaves it and every later
    worker would wait on it forever. One older than any build is removed, with a warning."""
    assert not native.clear_stale_lock(tmp_path)  # no lock: nothing to do
    lock = tmp_path / "lock"
    lock.touch()
    assert not native.clear_stale_lock(tmp_path) and lock.exists()  # a build under way keeps it
    old = lock.stat().st_mtime - native.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    with caplog.at_level("WARNING"):
        assert native.clear_stale_lock(tmp_path)
    assert not lock.exists() and "did not finish" in caplog.text


def test_an_isa_the_cpu_lacks_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: {"sse2"})
    monkeypatch.setenv("FUSEDSERVE_CPU_ISA", "avx512")
    with pytest.raises(native.NativeUnavailable, match="lacks"):
        native.chosen_isa()
    monkeypatch.setenv("FUSEDSERVE_CPU_ISA", "sve")
    with pytest.raises(native.NativeUnavailable, match="use one of"):
        native.chosen_isa()
    monkeypatch.delenv("FUSEDSERVE_CPU_ISA")
    assert native.best_isa({"avx2", "fma", "f16c"}) in ("avx2", "scalar")  # scalar off x86


def test_each_cpu_gets_its_best_build_and_never_the_test_twin(monkeypatch):
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    avx2 = {"avx2", "fma", "f16c"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert native.best_isa(avx2) == "avx2"
    assert native.best_isa(avx2 | {"avx_vnni"}) == "avxvnni"  # Alder Lake, Sierra Forest
    assert native.best_isa(avx512) == "avx512"  # Skylake-SP
    assert native.best_isa(avx512 | {"avx512_vnni"}) == "avx512vnni"  # Cascade Lake, Ice Lake
    assert native.best_isa(avx512 | {"avx512_vnni", "avx512_bf16"}) == "avx512bf16"  # Zen 4
    assert native.best_isa(avx512 | {"avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16"}) == "avx512bf16"
    monkeypatch.setattr(native, "cpu_flags", lambda: avx512 | {"avx512_vnni"})
    monkeypatch.setenv("FUSEDSERVE_CPU_ISA", "avxvnni_evex")  # asked for by name: allowed
    assert native.chosen_isa() == "avxvnni_evex"
    monkeypatch.setenv("FUSEDSERVE_CPU_ISA", "avxvnni")
    with pytest.raises(native.NativeUnavailable, match="avx_vnni"):
        native.chosen_isa()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norms_and_rotary_match_the_aten_ops(dtype):
    from fusedserve.kernels.layer_ops import rms_norm, rope_tables, rotary

    m = _module(ISAS[0])
    g = torch.Generator().manual_seed(4)
    n, h, kvh, hd, eps = 5, 4, 2, 32, 1e-6
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}

    def ref_norm(x, w):
        out = torch.empty_like(x)
        rms_norm(x, w, eps, out, torch.empty_like(x, dtype=torch.float32),
                 torch.empty(*x.shape[:-1], 1))
        return out

    x, add = torch.randn(n, 96, generator=g).to(dtype), torch.randn(n, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    want_x = x + add
    out, xs = torch.empty_like(x), x.clone()
    m.add_rms_norm(xs, add, w, eps, out)
    assert torch.equal(xs, want_x)
    torch.testing.assert_close(out, ref_norm(want_x, w), **tol)

    qkv = torch.randn(n, (h + 2 * kvh) * hd, generator=g).to(dtype)
    qw, kw = (1 + 0.1 * torch.randn(2, hd, generator=g)).to(dtype)
    cos, sin = rope_tables(hd, 10000.0, 64, dtype)
    pos = torch.tensor([0, 3, 7, 63, 20])
    c, s = cos[pos], sin[pos]
    q_ref = ref_norm(qkv[:, : h * hd].reshape(n, h, hd), qw)
    k_ref = ref_norm(qkv[:, h * hd : (h + kvh) * hd].reshape(n, kvh, hd), kw)
    for t in (q_ref, k_ref):
        rotary(t, c.unsqueeze(1), s.unsqueeze(1), torch.empty_like(t))
    q_out, fused = torch.empty(n, h, hd, dtype=dtype), qkv.clone()
    m.qk_norm_rope(fused, qw, kw, c, s, eps, q_out, h, kvh)
    torch.testing.assert_close(q_out, q_ref, **tol)
    torch.testing.assert_close(fused[:, h * hd : (h + kvh) * hd].reshape(n, kvh, hd), k_ref, **tol)
    assert torch.equal(fused[:, (h + kvh) * hd :], qkv[:, (h + kvh) * hd :]), "v untouched"


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vector_rounding_to_16_bits_is_torchs_at_ties_denormals_overflow_and_nan(isa, dtype):
    """The fused ops round a vector at a time (and bf16 by vcvtneps2bf16 where the build has it,
    which flushes denormals): the residual add, a float sum rounded once, must come out as torch's
    bit for bit, a tail past the last whole vector included."""
    m = _module(isa)
    tiny = torch.finfo(dtype).tiny
    eps = torch.finfo(dtype).eps
    pairs = [(1.0, eps / 2), (1.0 + eps, eps / 2), (-1.0, -eps / 2), (3.0, eps), (tiny / 4, tiny / 8),
             (-tiny / 2, tiny / 8), (torch.finfo(dtype).max, torch.finfo(dtype).max), (float("nan"), 1.0),
             (float("inf"), -1.0), (0.0, -0.0), (-0.0, -0.0), (1e-3, -1e-3)]
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 100, generator=g).to(dtype)
    add = torch.randn(3, 100, generator=g).to(dtype)
    for i, (a, b) in enumerate(pairs):  # each case inside a whole vector, and in the tail (96-99)
        for col in (16 * (i // 3) + 3, 96 + i // 3):
            x[i % 3, col], add[i % 3, col] = a, b
    want = (x.float() + add.float()).to(dtype)
    xs, out = x.clone(), torch.empty_like(x)
    m.add_rms_norm(xs, add, torch.ones(100, dtype=dtype), 1e-6, out)
    nan = want.isnan()
    assert torch.equal(xs.isnan(), nan)
    assert torch.equal(xs.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def _packed_module():
    m = _module(ISAS[0])
    if not m.has_packed():
        pytest.skip(f"the {m.isa()} build has no packed GEMM (AVX-512 BF16 only)")
    return m


@needs_native
@pytest.mark.parametrize("wkind", ["bf16", "int8"])
def test_packed_gemm_matches_reference_and_rows_do_not_depend_on_the_batch(wkind):
    from fusedserve.kernels.linear import Int8Weight, PackedWeight

    m = _packed_module()
    g = torch.Generator().manual_seed(5)
    # N tails, row-tile tails (7 and 8 rows: one tile, blocks of 3 vectors); past 18 rows int8 is
    # widened ahead rather than in registers
    for rows, k, n in [(1, 64, 16), (7, 130, 45), (8, 64, 100), (13, 256, 70), (6, 2, 1), (25, 96, 40)]:
        x = torch.randn(rows, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g) * 0.1
        if wkind == "int8":
            iw = Int8Weight.quantize(w, torch.bfloat16, torch.device("cpu"))
            p, wref = PackedWeight.pack(iw), iw.q.double() * iw.scale.double()[:, None]
        else:
            p, wref = PackedWeight.pack(w.bfloat16()), w.bfloat16().double()
        out = torch.empty(rows, n, dtype=torch.bfloat16)
        m.linear_packed(x, p.packed, p.scale, out)
        ref = x.double() @ wref.t()
        err = (out.double() - ref).abs().max().item()
        assert err <= 2 ** -7 * ref.abs().max().item() + 1e-3, f"{rows}x{k}x{n}: error {err}"
        for lo in range(rows):
            one = torch.empty(1, n, dtype=torch.bfloat16)
            m.linear_packed(x[lo : lo + 1], p.packed, p.scale, one)
            assert torch.equal(one, out[lo : lo + 1]), f"row {lo} of {rows} differs alone"


@pytest.mark.skipif(native.missing_toolchain() is not None, reason="no toolchain: nothing is built here")
def test_a_build_error_with_a_compiler_present_fails_instead_of_skipping(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "csrc"
    broken.mkdir()
    (broken / "kernels.h").write_bytes((native.CSRC / "kernels.h").read_bytes())
    (broken / "module.cpp").write_text('#include "kernels.h"\nthis is not C++;\n')
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.raises(native.NativeBuildError, match="failed"):
        native.build.__wrapped__("scalar", broken, name="fusedserve_broken")

    def failing(isa: str):
        raise native.NativeBuildError(f"building the native kernels for {isa} failed: test")

    monkeypatch.setattr(native, "build", failing)
    with pytest.raises(native.NativeBuildError):
        native.require()  # what the test session runs first: every test would fail
    native.kernels.cache_clear()
    try:
        assert native.kernels() is None  # a served model still falls back, with an error logged
        assert any(r.levelname == "ERROR" and "compiler present" in r.message for r in caplog.records)
    finally:
        native.kernels.cache_clear()


SHAPES = [(1, 64, 8), (5, 100, 13), (17, 258, 37), (4, 31, 4), (3, 7, 20), (13, 96, 33)]  # tails everywhere


def _rows_alone(kernel, weights: tuple, x: torch.Tensor, n: int) -> torch.Tensor:
    """``kernel(row, *weights, out)`` on each row of ``x`` alone, stacked: what a batch-invariant
    kernel gives for the whole batch."""
    outs = []
    for i in range(x.shape[0]):
        o = torch.empty(1, n, dtype=torch.float32)
        kernel(x[i : i + 1], *weights, o)
        outs.append(o)
    return torch.cat(outs)


def _quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 activations as the kernels make them (x times 1/scale, round half even)."""
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True)
    sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.clamp(torch.round(xf * (1 / sx)), -127, 127).double(), sx.double()


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
def test_packed_fma_gemm_matches_float64_and_the_batch(isa, wdtype):
    from fusedserve.kernels.linear import PackedWeight

    m = _module(isa)
    if m.vector_lanes() == 1:
        pytest.skip("the scalar build has no packed FMA GEMM")
    g = torch.Generator().manual_seed(5)
    for rows, k, n in SHAPES:
        x = torch.randn(rows, k, generator=g).bfloat16()
        w = (torch.randn(n, k, generator=g) * 0.1).to(wdtype)
        packed = PackedWeight.pack_fma(w, m.vector_lanes()).packed
        out = torch.empty(rows, n)
        m.linear_fma(x, packed, out)
        ref = x.double() @ w.double().t()
        assert (out.double() - ref).abs().max().item() <= 1e-5 * k, (isa, rows, k, n)
        assert torch.equal(out, _rows_alone(m.linear_fma, (packed,), x, n)), (isa, rows, k, n)


@needs_native
@pytest.mark.parametrize("isa", INT_ISAS)
def test_w8a8_gemm_is_the_exact_integer_product_whatever_the_batch(isa):
    from fusedserve.kernels.linear import Int8Weight, PackedWeight

    m = _module(isa)
    if not m.int8_lanes():
        pytest.skip("the scalar build has no int8 GEMM")
    g = torch.Generator().manual_seed(6)
    for rows, k, n in SHAPES:
        x = torch.randn(rows, k, generator=g).bfloat16()
        iw = Int8Weight.quantize(torch.randn(n, k, generator=g) * 0.1, torch.bfloat16, torch.device("cpu"))
        p = PackedWeight.pack_w8a8(iw, m.int8_lanes())
        out = torch.empty(rows, n)
        m.linear_w8a8(x, p.packed, p.scale, p.wsum, out)
        xq, sx = _quantized_rows(x)
        ref = (xq @ iw.q.double().t()) * sx * iw.scale.double()  # integer sums: exact in float64
        torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(out, _rows_alone(m.linear_w8a8, (p.packed, p.scale, p.wsum), x, n))


@needs_native
@pytest.mark.parametrize("isa", INT_ISAS)
def test_w4a8_gemm_matches_the_dequantized_weights_whatever_the_batch(isa):
    from fusedserve.kernels.linear import Int4Weight, PackedWeight
    from fusedserve.kernels.quantize import dequantize_int4

    m = _module(isa)
    if not m.int4_lanes():
        pytest.skip("the scalar build has no int4 GEMM")
    g = torch.Generator().manual_seed(7)
    for rows, k, n in SHAPES:
        x = torch.randn(rows, k, generator=g).bfloat16()
        iw = Int4Weight.quantize(torch.randn(n, k, generator=g) * 0.1, torch.device("cpu"))
        p = PackedWeight.pack_w4a8(iw, m.int4_lanes())
        out = torch.empty(rows, n)
        m.linear_w4a8(x, p.packed, p.scale, out)
        xq, sx = _quantized_rows(x)
        ref = (xq @ dequantize_int4(iw.u, iw.d, k, torch.float64).t()) * sx
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(out, _rows_alone(m.linear_w4a8, (p.packed, p.scale), x, n))


@needs_native
@pytest.mark.parametrize("isa", INT_ISAS)
def test_w4a8_gemm_with_zero_points_matches_the_dequantized_weights_whatever_the_batch(isa):
    """Asymmetric groups (AWQ, GPTQ): ``(u - z) * d`` with a uint8 zero point per group; z = 8
    everywhere equals the symmetric kernel bit for bit."""
    from fusedserve.kernels.linear import Int4Weight, PackedWeight
    from fusedserve.kernels.quantize import dequantize_int4

    m = _module(isa)
    if not m.int4_lanes():
        pytest.skip("the scalar build has no int4 GEMM")
    g = torch.Generator().manual_seed(8)
    for rows, k, n in SHAPES:
        x = torch.randn(rows, k, generator=g).bfloat16()
        groups = -(-k // 32)
        u = torch.randint(0, 16, (n, groups * 32), generator=g, dtype=torch.uint8)
        d = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).half()
        z = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)
        iw = Int4Weight(u, d, k, z)
        p = PackedWeight.pack_w4a8(iw, m.int4_lanes())
        out = torch.empty(rows, n)
        m.linear_w4a8(x, p.packed, p.scale, out, p.zeros)
        xq, sx = _quantized_rows(x)
        ref = (xq @ dequantize_int4(u, d, k, torch.float64, z).t()) * sx
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(out, _rows_alone(lambda a, b, c, e, o: m.linear_w4a8(a, b, c, o, e),
                                            (p.packed, p.scale, p.zeros), x, n))
        eight = PackedWeight.pack_w4a8(Int4Weight(u, d, k, torch.full_like(z, 8)), m.int4_lanes())
        sym, asym8 = torch.empty(rows, n), torch.empty(rows, n)
        m.linear_w4a8(x, p.packed, p.scale, sym)
        m.linear_w4a8(x, eight.packed, eight.scale, asym8, eight.zeros)
        assert torch.equal(sym, asym8)


def test_int4_quantization_keeps_each_groups_extreme_and_16_levels():
    from fusedserve.kernels.quantize import dequantize_int4, quantize_int4

    w = torch.randn(6, 70) * torch.logspace(-3, 1, 6)[:, None]  # rows of very different ranges; a tail group
    u, d = quantize_int4(w)
    assert u.shape == (6, 96) and d.shape == (6, 3) and int(u.max()) <= 15
    back = dequantize_int4(u, d, 70, torch.float32)
    groups = torch.nn.functional.pad(w, (0, 26)).view(6, 3, 32)
    extreme = groups.gather(2, groups.abs().argmax(2, keepdim=True)).squeeze(2)
    assert torch.allclose(back.view(6, -1)[:, :64].reshape(6, 2, 32).gather(
        2, groups[:, :2].abs().argmax(2, keepdim=True)).squeeze(2), extreme[:, :2], rtol=1e-3)
    assert int(u.min()) == 0, "each group's extreme is level 0 (-8): all 16 levels in use"
    step = d.float().abs().repeat_interleave(32, 1)[:, :70]
    err = (back - w).abs()
    # Half a step, but for values at +|extreme| (clamped from 8 to 7): one step.
    assert bool((err <= step / 2 + 1e-6).float().mean() > 0.95) and bool((err <= step + 1e-6).all())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_mul_and_the_cache_write_match_the_aten_ops(dtype):
    from fusedserve.kernels.aten.backend import TorchLayerOps
    from fusedserve.kernels.layer_ops import NormScratch, rope_tables
    from fusedserve.kernels.native.backend import NativeLayerOps

    m = _module(ISAS[0])
    g = torch.Generator().manual_seed(8)
    n, h, kvh, hd, inter = 5, 4, 2, 32, 200
    gate_up = (torch.randn(n, 2 * inter, generator=g) * 3).to(dtype)
    native_out, ref = torch.empty(n, inter, dtype=dtype), torch.empty(n, inter, dtype=dtype)
    NativeLayerOps(m, 1e-6, h, kvh).silu_mul(gate_up, native_out)
    TorchLayerOps(1e-6, 64, h, kvh, hd, torch.device("cpu")).silu_mul(gate_up.clone(), ref)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(native_out, ref, **tol)

    qkv = torch.randn(n, (h + 2 * kvh) * hd, generator=g).to(dtype)
    qw, kw = (1 + 0.1 * torch.randn(2, hd, generator=g)).to(dtype)
    cos, sin = (t[torch.tensor([0, 3, 7, 63, 20])] for t in rope_tables(hd, 10000.0, 64, dtype))
    slots = torch.tensor([9, 2, 14, 0, 5])
    caches = {}
    for name, ops in (("native", NativeLayerOps(m, 1e-6, h, kvh)),
                      ("aten", TorchLayerOps(1e-6, 64, h, kvh, hd, torch.device("cpu")))):
        kc, vc = torch.zeros(16, kvh, hd, dtype=dtype), torch.zeros(16, kvh, hd, dtype=dtype)
        work, q_out = qkv.clone(), torch.empty(n, h, hd, dtype=dtype)
        ops.qk_norm_rope(work, qw, kw, cos, sin, q_out, NormScratch.allocate(n, 64, h, kvh, hd, dtype, "cpu"),
                         kc, vc, slots)
        caches[name] = (kc, vc, q_out)
    for a, b in zip(caches["native"], caches["aten"]):
        torch.testing.assert_close(a, b, **tol)
    v = qkv[:, (h + kvh) * hd :].view(n, kvh, hd)
    assert torch.equal(caches["native"][1][slots], v), "v is copied as is"
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert not caches["native"][0][untouched].any(), "no other slot is written"


def _paged_chunks(spec: list[tuple[int, int]], kvh: int, d: int, bs: int, seed: int):
    """Caches with each chunk's context on shuffled pages; spec: (queries, context) per chunk.
    Returns caches, the block tables (row 0 a decode row's), the chunk table and the slots."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-ctx // bs) for _, ctx in spec) + 3
    kc = torch.randn(nblocks * bs, kvh, d, generator=g).bfloat16()
    vc = torch.randn(nblocks * bs, kvh, d, generator=g).bfloat16()
    perm = torch.randperm(nblocks, generator=g)
    width = max(-(-ctx // bs) for _, ctx in spec)
    bt = torch.zeros(len(spec) + 1, width, dtype=torch.int32)
    chunks, slots, used, start = [], [], 0, 1  # query row 0 is a decode row's: left alone
    for i, (n, ctx) in enumerate(spec):
        nb = -(-ctx // bs)
        bt[i + 1, :nb] = perm[used : used + nb]
        used += nb
        chunks.append([i + 1, start, n, ctx])
        slots.append((bt[i + 1, :nb].long()[:, None] * bs + torch.arange(bs)).flatten()[:ctx])
        start += n
    return kc, vc, bt, torch.tensor(chunks, dtype=torch.int64), slots, start


def _prompt_reference(q, kc, vc, chunks, slots, scale):
    """float64: query j of a chunk of n over ctx sees keys 0 .. ctx - n + j."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    g = q.shape[1] // kc.shape[1]
    for (_, start, n, ctx), s in zip(chunks.tolist(), slots, strict=True):
        k = kc[s].double().repeat_interleave(g, 1)  # [ctx, H, D]
        v = vc[s].double().repeat_interleave(g, 1)
        scores = torch.einsum("nhd,chd->hnc", q[start : start + n].double(), k) * scale
        visible = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
        p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start : start + n] = torch.einsum("hnc,chd->nhd", p, v)
    return out


@needs_native
@pytest.mark.parametrize("heads,kvh,d,bs", [(4, 4, 16, 4), (4, 2, 32, 16), (8, 2, 64, 4), (16, 2, 128, 16),
                                            (16, 1, 16, 16)])
def test_prompt_attention_over_pages_matches_float64(heads, kvh, d, bs):
    """Chunks with and without a cached prefix, one query to 70, in one call; bf16 out."""
    m = native.kernels()
    if not m.has_prompt_attention():
        pytest.skip("prompt_attention needs an AVX-512 BF16 build")
    spec = [(5, 5), (1, 1), (3, 40), (70, 70), (33, 101), (1, 17)]
    kc, vc, bt, chunks, slots, rows = _paged_chunks(spec, kvh, d, bs, seed=heads + d)
    q = torch.randn(rows, heads, d, generator=torch.Generator().manual_seed(7)).bfloat16()
    out = torch.full((rows, heads, d), 7.0).bfloat16()
    m.prompt_attention(q, kc, vc, bt, chunks, bs, d**-0.5, out)
    ref = _prompt_reference(q, kc, vc, chunks, slots, d**-0.5)
    assert torch.equal(out[0], torch.full((heads, d), 7.0).bfloat16())  # the decode row: untouched
    # bf16 rounding of the output and of the probabilities in the value product (2^-9 each).
    err = (out[1:].double() - ref[1:]).abs()
    assert (err <= 2**-8 * ref[1:].abs() + 4e-3 * vc.double().abs().max()).all(), err.max()


@needs_native
def test_prompt_attention_rows_do_not_depend_on_chunking_or_neighbours():
    """A row's sums depend only on its position, keys and query: one 40-token chunk, the same
    prompt as two chunks of 20 (the second after a 20-token prefix), and beside another chunk
    give the same bits."""
    m = native.kernels()
    if not m.has_prompt_attention():
        pytest.skip("prompt_attention needs an AVX-512 BF16 build")
    kc, vc, bt, _, _, _ = _paged_chunks([(40, 40)], 2, 32, 4, seed=3)
    q = torch.randn(41, 4, 32, generator=torch.Generator().manual_seed(4)).bfloat16()

    def run(chunks: list[list[int]], table: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(41, 4, 32).bfloat16()
        m.prompt_attention(q, kc, vc, table, torch.tensor(chunks, dtype=torch.int64), 4, 32**-0.5, out)
        return out

    whole = run([[1, 1, 40, 40]], bt)
    first = run([[1, 1, 20, 20]], bt)
    second = run([[1, 21, 20, 40]], bt)
    assert torch.equal(first[1:21], whole[1:21]) and torch.equal(second[21:41], whole[21:41])
    both = run([[1, 1, 20, 20], [2, 21, 20, 40]], torch.cat([bt, bt[1:]]))
    assert torch.equal(both[1:41], whole[1:41])


def _disassembly(src: str, flags: list[str], out: Path) -> list[tuple[str, str]]:
    """(first byte, mnemonic) of every instruction of ``csrc/src`` compiled with the native build's
    own compiler flags plus ``flags``, alignment padding left out."""
    import sysconfig

    from torch.utils import cpp_extension

    dirs = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    inc = [a for p in dirs for a in ("-isystem", p)]
    cmd = [os.environ.get("CXX", "c++"), "-c", str(native.CSRC / src), "-o", str(out), "-fPIC", "-std=c++20",
           "-O3", "-fopenmp", *inc, *flags]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    text = subprocess.run(["objdump", "-d", str(out)], check=True, capture_output=True, text=True).stdout
    insns = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and parts[2].strip():
            mnemonic = parts[2].split()[0] if not parts[2].startswith("{") else parts[2].split()[1]
            if not mnemonic.startswith(("nop", "xchg", "data16", "cs")):
                insns.append((parts[1].split()[0], mnemonic))
    return insns


@pytest.mark.skipif(native.missing_toolchain() is not None or shutil.which("objdump") is None
                    or platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="needs an x86 C++ toolchain with objdump")
def test_the_avx_vnni_build_is_its_tested_evex_twin_with_vex_dot_products(tmp_path):
    """The avxvnni build (Alder Lake, Sierra Forest) cannot run on a CPU without AVX-VNNI; the
    integer GEMMs' tests run its code as the avxvnni_evex twin wherever AVX-512 VNNI is. Compiled
    here side by side, the two are the same instructions in the same order, every vpdpbusd VEX in
    the one and EVEX in the other, and the avxvnni build holds no EVEX instruction (AVX-512: an
    illegal instruction on those CPUs)."""
    from concurrent.futures import ThreadPoolExecutor

    base = native.ISA_FLAGS["avx2"][1]
    jobs = [(src, kind, [*base, *extra]) for src in ("linear_int8.cpp", "linear_int4.cpp")
            for kind, extra in (("vex", ["-mavxvnni"]), ("evex", ["-DFS_VNNI256_EVEX"]))]
    with ThreadPoolExecutor(2) as pool:
        dis = list(pool.map(lambda j: _disassembly(j[0], j[2], tmp_path / f"{j[1]}_{j[0]}.o"), jobs))
    for (vex, evex), src in zip([(dis[0], dis[1]), (dis[2], dis[3])], ("linear_int8", "linear_int4")):
        assert [m for _, m in vex] == [m for _, m in evex], f"{src}: the builds differ beyond the encoding"
        dots = [b for b, m in vex if m == "vpdpbusd"]
        assert len(dots) >= 16 and set(dots) <= {"c4", "c5"}, f"{src}: vpdpbusd not VEX-encoded: {set(dots)}"
        assert {b for b, m in evex if m == "vpdpbusd"} == {"62"}, f"{src}: the twin's vpdpbusd is not EVEX"
        assert not [m for b, m in vex if b == "62"], f"{src}: the avxvnni build holds EVEX (AVX-512) code"
