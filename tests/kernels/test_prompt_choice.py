"""The prompt-attention choice (kernels/native/prompt_choice.py): SDPA (oneDNN's brgemm, AMX
where the CPU has it) against the native flash kernel, measured per head layout and cache dtype at
load; each chunk of a launch takes its bucket's path; both paths agree within the bf16 bound."""

from __future__ import annotations

import pytest
import torch

from fusedserve.kernels.native import build as native
from fusedserve.kernels.native.backend import NativeAttention
from fusedserve.kernels.native.gemm_choice import ROW_BUCKETS, GemmChooser, GemmTiming, bucket
from fusedserve.kernels.native.prompt_choice import choose_prompt_attention, timed_pair
from fusedserve.worker.model.qwen3 import Qwen3Model
from tests.model_batches import prompt_batch

needs_flash = pytest.mark.skipif(native.missing_toolchain() is not None or native.kernels() is None
                                 or not native.kernels().has_prompt_attention(),
                                 reason="the native flash prompt kernel needs an AVX-512 BF16 build")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: int, scale: float) -> torch.Tensor:
    """float64 attention of ``q`` [n, H, D] after ``p`` cached tokens over ``k``/``v`` [p + n, KVH, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("nhd,chd->hnc", q.double(), k) * scale
    n, ctx = q.shape[0], k.shape[0]
    visible = torch.arange(ctx)[None, :] <= (p + torch.arange(n))[:, None]
    return torch.einsum("hnc,chd->nhd", s.masked_fill(~visible, float("-inf")).softmax(-1), v)


def _close(out: torch.Tensor, ref: torch.Tensor, v_max: float) -> bool:
    """bf16 rounding of the output and of the probabilities in the value product (2^-9 each)."""
    return bool(((out.double() - ref).abs() <= 2**-8 * ref.abs() + 4e-3 * v_max).all())


@needs_flash
def test_each_chunk_takes_its_buckets_path_and_both_agree():
    """Chunks of 2, 5, 20 and 40 queries (two after a cached prefix) in one launch, SDPA chosen
    from 9 rows up: the small chunks' rows are the native kernel's bits, the large ones SDPA's,
    and every row is within the bf16 bound of float64."""
    m, bs, h, kvh, d = native.kernels(), 4, 4, 2, 32
    scale = d**-0.5
    lens, cached = [3, 5, 30, 40], [1, 0, 10, 0]
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(40, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(perm[used : used + -(-n // bs)])
        used += len(tables[-1])
    batch = prompt_batch([list(range(n)) for n in lens], tables, bs, cached)
    kc, vc = (torch.randn(40 * bs, kvh, d, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(batch.num_tokens, h, d, generator=g).bfloat16()
    sdpa_from_9 = tuple(i >= bucket(9) for i in range(len(ROW_BUCKETS)))

    def run(attention: NativeAttention) -> torch.Tensor:
        out = torch.full_like(q, 7.0)
        attention.begin(batch, bs)
        attention.attend(q, kc, vc, out)
        return out

    mixed = run(NativeAttention(m, scale, True, sdpa_from_9))
    flash = run(NativeAttention(m, scale, True))
    sdpa = run(NativeAttention(m, scale, False))
    start = 0
    for n, c, table in zip(lens, cached, tables, strict=True):
        rows = slice(start, start + n - c)
        want = sdpa if n - c >= 9 else flash
        assert torch.equal(mixed[rows], want[rows]), (n, c)
        slots = (torch.tensor(table)[:, None] * bs + torch.arange(bs)).flatten()[:n]
        ref = _reference(q[rows], kc[slots], vc[slots], c, scale)
        for out in (flash, sdpa):
            assert _close(out[rows], ref, vc.double().abs().max().item()), (n, c)
        start += n - c
    assert start == batch.num_tokens


@needs_flash
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_timed_kernels_compute_the_same_attention(kv_cache_dtype):
    """What the chooser times is the real work: the two kernels agree at every bucket's size."""
    h, kvh, d = 4, 2, 32
    on_native, on_sdpa = timed_pair(native.kernels(), h, kvh, d, kv_cache_dtype, d**-0.5)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 7, 64, ROW_BUCKETS[-1]):
        x = torch.randn(rows, h * d, generator=g).bfloat16()
        a, b = torch.empty_like(x), torch.empty_like(x)
        on_native(x, a)
        on_sdpa(x, b)
        assert a.abs().max() > 0.01
        torch.testing.assert_close(a.float(), b.float(), atol=0.02, rtol=0.02)


@needs_flash
def test_the_choice_is_measured_once_per_layout_and_cache_dtype(tmp_path, monkeypatch):
    chooser = GemmChooser("test", 2, tmp_path / "gemm.json")
    m = native.kernels()
    bf16 = choose_prompt_attention(chooser, m, 4, 2, 32, "auto", 32**-0.5)
    int8 = choose_prompt_attention(chooser, m, 4, 2, 32, "int8", 32**-0.5)
    assert len(bf16) == len(int8) == len(ROW_BUCKETS)
    keys = sorted(chooser.timings)
    assert len(keys) == 2 and "bf16-cache" in keys[0] and "int8-cache" in keys[1]
    assert all(set(chooser.timings[k].seconds) == {"native", "sdpa"} for k in keys)
    assert all(t > 0 for k in keys for ts in chooser.timings[k].seconds.values() for t in ts)

    def no_measuring(*a):
        raise AssertionError("measured again")

    monkeypatch.setattr(GemmChooser, "_measure", no_measuring)
    again = GemmChooser("test", 2, tmp_path / "gemm.json")
    assert choose_prompt_attention(again, m, 4, 2, 32, "auto", 32**-0.5) == bf16
    assert choose_prompt_attention(again, m, 4, 2, 32, "int8", 32**-0.5) == int8


@needs_flash
@pytest.mark.parametrize("gemm", ["auto", "native"])
def test_a_model_takes_sdpa_where_it_measured_faster_unless_kept_native(hf_checkpoints, monkeypatch, tmp_path,
                                                                         gemm):
    """As on a host where SDPA measured 2x faster at every bucket: ``auto`` sends every prompt
    chunk there (logits within bf16 bounds of the native kernel's) and the model's kernel info
    says so; ``native`` never measures."""
    monkeypatch.setenv("FUSEDSERVE_CACHE", str(tmp_path))
    n = len(ROW_BUCKETS)
    monkeypatch.setattr(GemmChooser, "_measure", lambda self, k, n_, rows, paths, dtype: GemmTiming(
        {p: ((2.0 if p == "native" else 1.0),) * n for p in paths}))
    ckpt = hf_checkpoints["gqa2_untied"]
    model = Qwen3Model.from_pretrained(ckpt, "bfloat16", gemm=gemm)
    ws = model.new_workspace(32, 4)
    assert ws.attention.sdpa_rows == ((True,) * n if gemm == "auto" else ())
    # stats name the choice: whether AMX could have run (SDPA's brgemm) is visible
    named = f"+ sdpa-bf16-cache prompts from {ROW_BUCKETS[0]} rows"
    assert (named in model.kernel_info()["attention"]) == (gemm == "auto")
    ref = Qwen3Model.from_pretrained(ckpt, "bfloat16", gemm="native")
    logits = []
    for mdl, w in ((model, ws), (ref, ref.new_workspace(32, 4))):
        out = torch.empty(2, mdl.config.vocab_size)
        mdl.forward(prompt_batch([list(range(3, 24)), [5, 6, 7]], [[0, 1, 2, 3, 4, 5], [6]], 4),
                    mdl.new_kv_cache(16, 4), w, out)
        logits.append(out)
    torch.testing.assert_close(logits[0], logits[1], atol=0.05, rtol=0.02)
