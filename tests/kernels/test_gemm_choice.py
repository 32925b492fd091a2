"""The CPU's GEMM choice (kernels/native/gemm_choice.py): oneDNN's matrix-engine GEMM against the native
kernels, measured per shape and row bucket at load, cached per host; the int8 matrix path equal to
the native W8A8 kernel bit for bit, the bf16 one within a stated bound; the model's logits under
either path; no allocation per decode step on the matrix path."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fusedserve.kernels.backend_table import native as native_backend
from fusedserve.kernels.linear import Int8Weight, LinearOp, _vnni_blocks
from fusedserve.kernels.native import build as native
from fusedserve.kernels.native.gemm_choice import ROW_BUCKETS, GemmChooser, GemmTiming, bucket
from fusedserve.worker.model.qwen3 import Qwen3Model
from tests.model_batches import decode_batch, prompt_batch

needs_w8a8 = pytest.mark.skipif(native.missing_toolchain() is not None or native.kernels() is None
                                or not native.kernels().int8_lanes(), reason="no native W8A8 build here")
SHAPES = [(1, 64, 8), (5, 100, 13), (17, 258, 37), (4, 31, 4), (64, 96, 33), (300, 64, 40)]


def _op() -> LinearOp:
    return LinearOp(torch.device("cpu"), native.kernels(), torch.bfloat16, gemm="native")


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@needs_w8a8
def test_int8_matrix_path_equals_native_w8a8_bit_for_bit(act, out_dtype):
    op, g = _op(), torch.Generator().manual_seed(0)
    for rows, k, n in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.1
        p = op.prepare(Int8Weight.quantize(w, torch.bfloat16, torch.device("cpu")))
        p.matrix = Int8Weight.quantize(w, torch.bfloat16, torch.device("cpu")).q
        x = (torch.randn(rows, k, generator=g) * 3).to(act)
        a, b = torch.empty(rows, n, dtype=out_dtype), torch.empty(rows, n, dtype=out_dtype)
        op(x, p, a, path="native")
        op(x, p, b, path="onednn")
        assert torch.equal(a, b), (rows, k, n)
        if k % 4 == 0:
            p.brgemm = _vnni_blocks(p.matrix, native.kernels().brgemm_block(), 4)
            c = torch.empty(rows, n, dtype=out_dtype)
            try:
                op(x, p, c, path="brgemm")
            except RuntimeError:  # oneDNN's int8 micro-kernel needs AMX on x86: the chooser leaves it out
                assert not op._agrees(p, "brgemm"), (rows, k, n)
            else:
                assert torch.equal(a, c), (rows, k, n)
        ref = x.double() @ w.double().t()
        assert (a.double() - ref).abs().max() <= 0.05 * ref.abs().max() + 1e-3, (rows, k, n)


@needs_w8a8
def test_bf16_matrix_path_within_the_stated_bound():
    """Both sum exact bf16 products in fp32, in different orders: |diff| <= 1e-5 K max|x| max|w|
    before the output's bf16 rounding (one bf16 ulp of the larger result on top)."""
    op, g = _op(), torch.Generator().manual_seed(1)
    if not op.packs:
        pytest.skip("no bf16 packed GEMM in this build")
    for rows, k, n in SHAPES:
        if k % 2:
            continue
        w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
        p = op.prepare(w)
        p.matrix = w
        x = torch.randn(rows, k, generator=g).bfloat16()
        a, b = torch.empty(rows, n, dtype=torch.bfloat16), torch.empty(rows, n, dtype=torch.bfloat16)
        p.brgemm = _vnni_blocks(w, native.kernels().brgemm_block(), 2)
        op(x, p, a, path="native")
        bound = 1e-5 * k * x.float().abs().max() * w.float().abs().max()
        for path in ("onednn", "brgemm"):
            op(x, p, b, path=path)
            ulp = torch.maximum(a.float().abs(), b.float().abs()) * 2.0**-7
            assert ((a.float() - b.float()).abs() <= bound + ulp).all(), (rows, k, n, path)


def test_buckets_and_the_margin():
    assert [bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 512, 513, 4096)] == [0, 1, 2, 2, 3, 3, 4, 9, 9, 9]
    assert ROW_BUCKETS[bucket(100)] == 128
    t = GemmTiming({"native": (1.0, 1.0, 1.0), "onednn": (2.0, 0.95, 0.5)})
    assert t.choice == ("native", "native", "onednn")  # 5% faster is noise; 2x is a choice
    # A win between losses (noise in one bucket) is not taken; from a crossover on, every bucket is.
    assert GemmTiming({"native": (1.0,) * 5, "onednn": (0.5, 2.0, 0.5, 2.0, 2.0)}).choice == ("native",) * 5
    assert GemmTiming({"native": (1.0,) * 4, "onednn": (2.0, 0.5, 0.5, 0.5)}).choice == (
        "native", "onednn", "onednn", "onednn")
    # Several matrix paths: each bucket takes the fastest, if one of them beats native from there on.
    both = GemmTiming({"native": (1.0,) * 4, "onednn": (2.0, 0.5, 0.4, 0.3), "brgemm": (2.0, 0.6, 0.3, 0.35)})
    assert both.choice == ("native", "onednn", "brgemm", "onednn")
    assert GemmTiming({"native": (1.0, 1.0)}).choice == ("native", "native")


def test_the_faster_path_is_chosen_and_the_timing_cached(tmp_path):
    calls = {"native": 0, "matrix": 0}

    def slow(x, out):
        calls["native"] += 1
        time.sleep(0.004)

    def fast(x, out):
        calls["matrix"] += 1

    path = tmp_path / "gemm.json"
    chooser = GemmChooser("test", 2, path)
    choice = chooser.choose("bfloat16", 16, 8, 4, {"native": slow, "onednn": fast}, torch.bfloat16)
    assert choice == ("onednn",) * len(ROW_BUCKETS)  # measured up to 4 rows, the rest takes the last
    assert calls["native"] == calls["matrix"] > 0
    assert "bfloat16:16x8:rows4" in json.loads(path.read_text())
    # Reversed speeds, another shape: the native kernel keeps it.
    assert chooser.choose("w8a8", 16, 8, 2, {"native": fast, "onednn": slow},
                          torch.bfloat16) == ("native",) * len(ROW_BUCKETS)
    # A second process on this host reads the cache and times nothing.
    before = dict(calls)
    again = GemmChooser("test", 2, path)
    assert again.choose("bfloat16", 16, 8, 4, {"native": slow, "onednn": fast}, torch.bfloat16) == choice
    assert calls == before and again.measured_s == 0.0
    # Another set of paths for the same shape (a build that gained one) is measured afresh.
    assert again.choose("bfloat16", 16, 8, 4, {"native": slow, "onednn": fast, "brgemm": fast},
                        torch.bfloat16)[0] in ("onednn", "brgemm")
    assert calls["native"] > before["native"]


def test_the_cache_key_tells_apart_cpus_a_hypervisor_names_alike(monkeypatch):
    """A VM shows Zen 4 and Zen 5 both as "AMD EPYC": their timings must not share a file."""
    from fusedserve.kernels.native import gemm_choice

    monkeypatch.setattr(gemm_choice, "cpu_model", lambda: "AMD EPYC")
    keys = set()
    for generation, flags in [("AuthenticAMD family 25 model 17 stepping 1", {"avx512f"}),
                              ("AuthenticAMD family 26 model 2 stepping 1", {"avx512f"}),
                              ("AuthenticAMD family 26 model 2 stepping 1", {"avx512f", "avx_vnni"})]:
        monkeypatch.setattr(gemm_choice, "cpu_generation", lambda g=generation: g)
        monkeypatch.setattr(gemm_choice, "cpu_flags", lambda f=flags: f)
        keys.add(gemm_choice.host_key("avx512bf16", 2))
    assert len(keys) == 3
    assert gemm_choice.host_key("avx512bf16", 2) == gemm_choice.host_key("avx512bf16", 2)


def test_a_matrix_gemm_that_raises_leaves_the_native_kernel(tmp_path):
    def broken(x, out):
        raise RuntimeError("no such shape")

    chooser = GemmChooser("test", 2, tmp_path / "gemm.json")
    paths = {"native": lambda x, out: None, "onednn": broken}
    assert set(chooser.choose("w8a8", 16, 8, 8, paths, torch.bfloat16)) == {"native"}


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="auto, native"):
        LinearOp(torch.device("cpu"), native.kernels(), torch.bfloat16, gemm="amx-please")


@pytest.fixture
def matrix_everywhere(monkeypatch, tmp_path, request):
    """The chooser as if oneDNN's matmul had measured 2x faster at every bucket (a host with AMX),
    or its brgemm (``request.param``); prompt attention kept native (its choice:
    tests/kernels/test_prompt_choice.py)."""
    fast = getattr(request, "param", "onednn")
    monkeypatch.setenv("FUSEDSERVE_CACHE", str(tmp_path))
    n = len(ROW_BUCKETS)

    def measure(self, k, n_, max_rows, paths, act_dtype):
        return GemmTiming({p: ((1.0 if p == fast else 2.0),) * n for p in paths})

    monkeypatch.setattr(GemmChooser, "_measure", measure)
    return fast
    monkeypatch.setattr(native_backend, "choose_prompt_attention", lambda *a: (False,) * n)


def _skip_unless_chosen_here(path: str, quantization: str | None) -> None:
    """The matrix paths this host can run: an AVX2 build packs 16-bit weights for its FMA kernel
    (no matrix path is offered), and oneDNN's int8 brgemm micro-kernel needs AMX on x86."""
    op = _op()
    if quantization is None and not op.packs:
        pytest.skip("16-bit weights take the FMA kernel on this build: no matrix path to choose")
    if path == "brgemm" and quantization == "int8":
        w = Int8Weight.quantize(torch.randn(8, 64) * 0.1, torch.bfloat16, torch.device("cpu"))
        p = op.prepare(w)
        p.matrix = w.q
        p.brgemm = _vnni_blocks(w.q, native.kernels().brgemm_block(), 4)
        try:
            op(torch.randn(2, 64).bfloat16(), p, torch.empty(2, 8, dtype=torch.bfloat16), path="brgemm")
        except RuntimeError as exc:
            pytest.skip(f"int8 brgemm does not run here: {exc}")


def _logits(model: Qwen3Model) -> torch.Tensor:
    """A 21-token prompt chunk and 3 prompts of a batch: every projection at 1..21 rows."""
    bs = 4
    kv, ws = model.new_kv_cache(32, bs), model.new_workspace(32, bs)
    out = torch.empty(3, model.config.vocab_size)
    model.forward(prompt_batch([list(range(3, 24)), [5, 6], [7]], [[0, 1, 2, 3, 4, 5], [6], [7]], bs),
                  kv, ws, out)
    return out


@needs_w8a8
@pytest.mark.parametrize("matrix_everywhere", ["onednn", "brgemm"], indirect=True)
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_model_logits_on_the_matrix_path(hf_checkpoints, matrix_everywhere, caplog, quantization):
    _skip_unless_chosen_here(matrix_everywhere, quantization)
    ckpt = hf_checkpoints["gqa2_untied"]
    ref = Qwen3Model.from_pretrained(ckpt, "bfloat16", quantization=quantization, gemm="native")
    with caplog.at_level(logging.INFO, logger="fusedserve.kernels.native.gemm_choice"):
        model = Qwen3Model.from_pretrained(ckpt, "bfloat16", quantization=quantization, gemm="auto")
    path = matrix_everywhere
    assert path in model.kernel_info()["linear"] and path not in ref.kernel_info()["linear"]
    assert any(f"1:{path}" in r.message for r in caplog.records)  # the choice is logged
    a, b = _logits(ref), _logits(model)
    if quantization == "int8":
        assert torch.equal(a, b)  # exact int32 sums, the same quantization and scaling
    else:
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)
        assert (a.argmax(-1) == b.argmax(-1)).all()


@needs_w8a8
@pytest.mark.parametrize("matrix_everywhere", ["onednn", "brgemm"], indirect=True)
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_matrix_path_decode_allocates_nothing_after_warmup(hf_checkpoints, matrix_everywhere, quantization):
    _skip_unless_chosen_here(matrix_everywhere, quantization)
    model = Qwen3Model.from_pretrained(hf_checkpoints["gqa2_untied"], "bfloat16", quantization=quantization)
    assert matrix_everywhere in model.kernel_info()["linear"]
    bs = 4
    kv, ws = model.new_kv_cache(16, bs), model.new_workspace(4, bs)
    out = torch.empty(4, model.config.vocab_size)
    model.forward(prompt_batch([[4, 5, 6, 7, 8]], [[3, 1]], bs), kv, ws, out[:1])
    batch = decode_batch([(9, 5, [3, 1]), (9, 5, [3, 1])], bs)
    model.forward(batch, kv, ws, out[:2])  # warm-up: the int8 scratch grows here
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model.forward(batch, kv, ws, out[:2])
    allocs = [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocs == [], allocs[:10]


@needs_w8a8
@pytest.mark.parametrize("wkind", ["bfloat16", "w8a8"])
def test_a_brgemm_path_that_disagrees_with_native_is_left_out(tmp_path, monkeypatch, caplog, wkind):
    """The brgemm pack is checked against the native kernel once at load: where this host's
    micro-kernel read it otherwise (a layout it does not take), the path is not even timed."""
    monkeypatch.setenv("FUSEDSERVE_CACHE", str(tmp_path))
    build = native.kernels()
    seen: list[set[str]] = []

    def measure(self, k, n, max_rows, paths, act_dtype):
        seen.append(set(paths))
        return GemmTiming({p: ((1.0 if p == "brgemm" else 2.0),) * len(ROW_BUCKETS) for p in paths})

    monkeypatch.setattr(GemmChooser, "_measure", measure)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=g) * 0.1
    cpu = torch.device("cpu")
    weight = w.bfloat16() if wkind == "bfloat16" else Int8Weight.quantize(w, torch.bfloat16, cpu)
    op = LinearOp(torch.device("cpu"), build, torch.bfloat16, gemm="auto")
    if not op.packs:
        pytest.skip("no packed bf16 GEMM in this build")
    p = op.prepare(weight)
    if "brgemm" in seen[0]:  # this host's micro-kernel runs and agrees: it is timed and chosen
        assert p.paths and set(p.paths) == {"brgemm"} and p.brgemm is not None
    with caplog.at_level(logging.WARNING, logger="fusedserve.kernels.linear"):
        monkeypatch.setattr(build, "linear_brgemm", lambda x, packed, out: out.fill_(1.0))
        monkeypatch.setattr(build, "linear_brgemm_w8a8", lambda q, packed, wsum, acc: acc.fill_(1))
        p = LinearOp(torch.device("cpu"), build, torch.bfloat16, gemm="auto").prepare(weight)
    assert seen[-1] == {"native", "onednn"} and p.brgemm is None and p.paths == ()
    if "brgemm" in seen[0]:
        assert "disagrees" in caplog.text
