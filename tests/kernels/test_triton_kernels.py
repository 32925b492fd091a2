"""The Triton layer kernels against ``TorchLayerOps`` on the CPU, under Triton's interpreter,
with tails in every dimension, scattered cache slots and GQA; and each kernel compiled ahead
of time for the H200's sm_90 on this CPU host (ptxas ships with triton), which catches the
register, shared-memory and layout errors the interpreter cannot.

On a GPU machine, ``FUSEDSERVE_TRITON_COMPILED=1`` runs the same tests compiled, on CUDA
(``benchmarks/gpu_check.sh``)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from tests.kernels.triton_mode import choose

COMPILED = choose()

from fusedserve.kernels import sampler  # noqa: E402
from fusedserve.kernels.aten.backend import TorchLayerOps  # noqa: E402
from fusedserve.kernels.layer_ops import NormScratch, rope_tables  # noqa: E402
from fusedserve.kernels.triton.decode_attention import DecodeAttentionScratch, decode_attention  # noqa: E402
from fusedserve.kernels.triton.layer_ops import TritonLayerOps  # noqa: E402
from fusedserve.kernels.triton.prompt_attention import prompt_attention  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
CPU = torch.device("cpu")
DEV = torch.device("cuda" if COMPILED else "cpu")  # where the Triton kernels run


def _on_dev(fn, *args) -> None:
    """``fn(*args)`` with the tensors on ``DEV`` (the interpreter: the CPU, as they are), and
    what it wrote copied back into the caller's tensors."""
    moved = [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]
    fn(*moved)
    for a, m in zip(args, moved):
        if isinstance(a, torch.Tensor) and m is not a:
            a.copy_(m.cpu())


class _Triton:
    """``TritonLayerOps`` run through ``_on_dev``."""

    def __init__(self, *args):
        self.ops = TritonLayerOps(*args)

    def __getattr__(self, name: str):
        return lambda *args: _on_dev(getattr(self.ops, name), *args)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: to rounding (the logic: indexing, masks, slots, tails). bf16: to bf16's precision
    only, a few percent: the interpreter rounds fp32 -> bf16 toward zero where a GPU and ATen
    round to nearest, and each kernel rounds two or three times in a row (the GPU run of the
    same tests compares bf16 as the model runs it)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=4e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,d", [(1, 64), (5, 100), (9, 257)])
def test_add_rms_norm(dtype, n, d):
    g = torch.Generator().manual_seed(n * d)
    x, add = torch.randn(n, d, generator=g).to(dtype), torch.randn(n, d, generator=g).to(dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype)
    ref = TorchLayerOps(1e-6, d, 2, 1, 8, CPU)
    buf = NormScratch.allocate(n, d, 2, 1, 8, dtype, CPU)
    xa, outa = x.clone(), torch.empty_like(x)
    ref.add_rms_norm(xa, add, w, outa, buf)
    xb, outb = x.clone(), torch.empty_like(x)
    _Triton(1e-6, 2, 1).add_rms_norm(xb, add, w, outb, buf)
    _close(xb, xa)  # the residual sum, rounded once
    _close(outb, outa)
    outc = torch.empty_like(x)
    _Triton(1e-6, 2, 1).add_rms_norm(x.clone(), None, w, outc, buf)
    ref.add_rms_norm(x.clone(), None, w, outa, buf)
    _close(outc, outa)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1), (2, 2)])
def test_qk_norm_rope_writes_the_cache_slots(dtype, heads, kv_heads):
    n, hd, slots = 7, 32, 40
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * hd, generator=g).to(dtype)
    qw, kw = (torch.rand(hd, generator=g) + 0.5).to(dtype), (torch.rand(hd, generator=g) + 0.5).to(dtype)
    cos_t, sin_t = rope_tables(hd, 10000.0, 64, dtype)
    positions = torch.tensor([0, 5, 17, 3, 63, 8, 9])
    cos, sin = cos_t[positions], sin_t[positions]
    slot_mapping = torch.tensor([33, 2, 17, 39, 0, 21, 8])  # scattered, out of order
    outs = []
    for ops in (TorchLayerOps(1e-6, heads * hd, heads, kv_heads, hd, CPU),
                _Triton(1e-6, heads, kv_heads)):
        q = qkv.clone()
        q_out = torch.empty(n, heads, hd, dtype=dtype)
        kc, vc = torch.zeros(slots, kv_heads, hd, dtype=dtype), torch.zeros(slots, kv_heads, hd, dtype=dtype)
        buf = NormScratch.allocate(n, heads * hd, heads, kv_heads, hd, dtype, CPU)
        ops.qk_norm_rope(q, qw, kw, cos, sin, q_out, buf, kc, vc, slot_mapping)
        outs.append((q, q_out, kc, vc))
    (qa, qoa, kca, vca), (qb, qob, kcb, vcb) = outs
    _close(qob, qoa)
    _close(qb, qa)  # k normed and rotated in place (v untouched)
    _close(kcb, kca)
    assert torch.equal(vcb, vca)  # v copied as is
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert not kcb[untouched].any() and not vcb[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(6, 2 * 1100, generator=g).to(dtype)  # 1100: a tail past one block of 1024
    want, got = torch.empty(6, 1100, dtype=dtype), torch.empty(6, 1100, dtype=dtype)
    TorchLayerOps(1e-6, 8, 2, 1, 4, CPU).silu_mul(gate_up.clone(), want)
    _Triton(1e-6, 2, 1).silu_mul(gate_up, got)
    _close(got, want)


def test_token_bitmask():
    vocab = 5000  # past one block of 4096, and not a multiple of 32
    words = -(-vocab // 32)
    g = torch.Generator().manual_seed(7)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    bitmask[1] = -1
    logits = torch.randn(3, vocab, generator=g)
    want, got = logits.clone(), logits.clone()
    TorchLayerOps(1e-6, 8, 2, 1, 4, CPU).apply_token_bitmask(want, bitmask)
    _Triton(1e-6, 2, 1).apply_token_bitmask(got, bitmask)
    assert torch.equal(got, want)
    assert torch.isinf(got).any() and torch.equal(got[1], logits[1])
    allowed = sampler.allowed_tokens(bitmask, vocab, sampler.bit_table("cpu"))
    assert torch.equal(torch.isinf(got), ~allowed)


def _reference_attention(q, k_cache, v_cache, tables, lens, bs):
    """Each row's context gathered slot by slot, then plain softmax attention in float64."""
    b, nh, hd = q.shape
    group = nh // k_cache.shape[1]
    out = torch.empty(b, nh, hd, dtype=torch.float64)
    for r in range(b):
        n = int(lens[r])
        slots = [int(tables[r, p // bs]) * bs + p % bs for p in range(n)]
        k, v = k_cache[slots].double(), v_cache[slots].double()  # [n, nkv, hd]
        for h in range(nh):
            s = (k[:, h // group] @ q[r, h].double()) * hd**-0.5
            out[r, h] = torch.softmax(s, 0) @ v[:, h // group]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,splits", [(4, 2, 4), (8, 1, 3), (2, 2, 1)])
def test_paged_decode_attention_reads_the_pages_in_place(dtype, heads, kv_heads, splits):
    """Long and short rows in one batch (a row of one token, rows past one split), scattered
    pages, GQA groups of 1, 2 and 8, and a split count that does not divide the context."""
    hd, bs, num_blocks = 32, 4, 128
    g = torch.Generator().manual_seed(heads * 7 + splits)
    k_cache = torch.randn(num_blocks * bs, kv_heads, hd, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * bs, kv_heads, hd, generator=g).to(dtype)
    lens = torch.tensor([1, 37, 96, 5, 64], dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = perm[: 5 * 24].view(5, 24)  # every row's pages scattered over the cache
    q = torch.randn(5, heads, hd, generator=g).to(dtype)
    out = torch.empty_like(q)
    scratch = DecodeAttentionScratch(8, heads, hd, splits, DEV)
    _on_dev(decode_attention, q, k_cache, v_cache, tables, lens, bs, hd**-0.5, out, scratch)
    want = _reference_attention(q, k_cache, v_cache, tables, lens, bs)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(COMPILED, reason="counts the interpreter's loads; on a GPU, "
                    "fusedserve.benchmarks.cuda_profile "
                    "times max_model_len 40,960 against 4,128")
def test_a_rows_attention_cost_follows_its_own_length_not_max_model_len(monkeypatch):
    """The K tiles each program of a decode row's attention loads, counted under the interpreter.
    A row's cost is its keys read and its critical path (the most any one split reads: the splits
    run in parallel). For rows of 37 and 300 tokens both are the same whether the block table is
    4,128 or 40,960 tokens wide (Qwen3's max_model_len; 16 splits both): the keys within one tile
    per split of the row's own length, the path one split of it (length / 16, in whole tiles)."""
    from triton.runtime import interpreter

    hd, bs, splits, block_n = 32, 16, 16, 16
    k_cache = torch.randn(32 * bs, 1, hd)  # one KV head (a program per row, KV head and split)
    v_cache = torch.randn(32 * bs, 1, hd)
    lo, hi = k_cache.data_ptr(), k_cache.data_ptr() + k_cache.nbytes
    keys: dict[tuple, int] = {}  # per program (row, KV head, split)
    load = interpreter.InterpreterBuilder.create_masked_load

    def counting(self, ptrs, mask, other, *args):
        if ((ptrs.data >= lo) & (ptrs.data < hi)).any():  # a K tile: block_n keys x head_dim
            keys[self.grid_idx] = keys.get(self.grid_idx, 0) + ptrs.data.size // hd
        return load(self, ptrs, mask, other, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", counting)

    def cost(length: int, max_model_len: int) -> tuple[int, int]:
        tables = torch.zeros(1, max_model_len // bs, dtype=torch.int32)
        tables[0, :32] = torch.randperm(32, generator=torch.Generator().manual_seed(length)).int()
        q = torch.randn(1, 4, hd)
        scratch = DecodeAttentionScratch(1, 4, hd, splits, CPU)
        keys.clear()
        decode_attention(q, k_cache, v_cache, tables, torch.tensor([length], dtype=torch.int32), bs,
                         hd**-0.5, torch.empty_like(q), scratch, block_n)
        return sum(keys.values()), max(keys.values())

    for length in (37, 300):
        narrow, wide = cost(length, 4128), cost(length, 40960)
        assert narrow == wide, (length, narrow, wide)
        total, path = wide
        assert length <= total < length + splits * block_n, (length, wide)
        assert path == math.ceil(math.ceil(length / splits) / block_n) * block_n, (length, wide)
    assert cost(300, 40960)[1] > cost(37, 40960)[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (2, 2)])
def test_prompt_attention_over_the_pages_equals_the_chunk_path(dtype, heads, kv_heads):
    """Two decode rows, then prompt chunks in one launch: a whole prompt (37 tokens, past two query
    blocks), a chunk after a 20-token cached prefix, and a one-token chunk; scattered pages."""
    from fusedserve.kernels.attention.prompt_rows import attend_chunks, plan_chunks
    from fusedserve.kernels.forward_batch import ForwardBatch

    hd, bs, num_blocks = 16, 4, 96
    g = torch.Generator().manual_seed(heads + kv_heads)
    k_cache = torch.randn(num_blocks * bs, kv_heads, hd, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * bs, kv_heads, hd, generator=g).to(dtype)
    query_lens, seq_lens = [1, 1, 37, 13, 1], [9, 30, 37, 33, 12]
    tables = torch.randperm(num_blocks, generator=g).to(torch.int32)[: 5 * 10].view(5, 10)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    t = int(qsl[-1])
    zeros = torch.zeros(t, dtype=torch.int32)
    batch = ForwardBatch(zeros, zeros, zeros.long(), qsl, torch.tensor(seq_lens, dtype=torch.int32), tables,
                         num_decode=2, prompt_query_lens=query_lens[2:], prompt_seq_lens=seq_lens[2:])
    q = torch.randn(t, heads, hd, generator=g).to(dtype)
    want, got = torch.zeros_like(q), torch.zeros_like(q)
    attend_chunks(plan_chunks(batch, bs), q, k_cache, v_cache, want, hd**-0.5)
    _on_dev(prompt_attention, q, k_cache, v_cache, qsl, batch.seq_lens, tables, 2, query_lens[2:], bs,
            hd**-0.5, got)
    assert not got[:2].any()  # decode rows are not this kernel's
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[2:].float(), want[2:].float(), atol=tol, rtol=tol)


def _compiled(args: list[str]) -> str:
    """The output of ``python ARGS`` outside the interpreter, compiling for sm_90 on this host
    (skipped where triton has no ptxas; exit 1 of aot_check: a variant spills registers)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=env)
    if run.returncode and ("ptxas" in run.stderr and "not found" in run.stderr):
        pytest.skip("no ptxas for ahead-of-time compilation here")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def test_kernels_compile_ahead_of_time_for_sm90():
    """Compiled for the H200 (sm_90) on this CPU host, outside the interpreter."""
    out = _compiled(["-m", "fusedserve.kernels.triton.aot_check", "--arch", "90"])
    lines = [ln for ln in out.splitlines() if ": cubin " in ln]
    names = [ln.split(":")[0] for ln in lines]
    assert [f"decode_attention_split_gqa{g}" for g in range(1, 17)] == [n for n in names if "split" in n]
    assert {"prompt_attention_16x16_bf16", "prompt_attention_16x16_fp32_ieee"} <= set(names)
    sampler_kernels = {"sampler_row", "sampler_draw", "sampler_select_cut_round3", "sampler_select_kth_done"}
    assert sampler_kernels <= set(names)
    assert {"lora_shrink", "lora_expand"} <= set(names)
    assert len(names) == 36 and all(ln.endswith(", 0 spill bytes") for ln in lines), out


def test_float32_products_are_ieee_and_per_launch_integers_are_not_specialised():
    """On NVIDIA ``tl.dot`` of float32 defaults to TF32 (~1e-3 off, which the interpreter does not
    show): the prompt kernel asks for IEEE products on float32 inputs. Compiled for sm_90 (no
    GPU needed), its float32 PTX has no TF32 MMA and its bf16 PTX has bf16 MMA. Launch-varying
    integers (first row, table stride; the sampler's batch, vocabulary and strides) are not
    specialised on; the split length is the row's own."""
    from fusedserve.kernels.triton import decode_attention as attn
    from fusedserve.kernels.triton import prompt_attention as prompt

    assert prompt.dot_precision(torch.float32) == "ieee"
    assert [attn.split_block_n(g) for g in (2, 4, 8, 16, 32)] == [16, 16, 16, 8, 4]
    code = (
        "from fusedserve.kernels.triton import aot_check as a\n"
        "for f32 in (True, False):\n"
        "    ptx = a.compile_job(a._prompt(16, f32)).asm['ptx']\n"
        "    print(f32, 'tf32' in ptx, 'bf16' in ptx and ('mma' in ptx))\n"
        "from fusedserve.kernels.triton import decode_attention as d, prompt_attention as p, sampler as s\n"
        "for k in (p._prompt_kernel, d._split_kernel, s._select_hist_kernel, s._draw_kernel):\n"
        "    print(sorted(q.name for q in k.params if q.do_not_specialize))\n")
    out = _compiled(["-c", code])
    assert out.split("\n")[:6] == ["True False False", "False False True", "['first_row', 'stride_tb']",
                                   "['stride_tb']", "['B', 'NC', 'V', 'n', 'stride_l']",
                                   "['NC', 'V', 'n', 'stride_l']"], out


@pytest.mark.skipif(COMPILED, reason="on a GPU, tests/kernels/test_cuda.py runs the engine on these kernels")
def test_a_model_forward_on_the_triton_kernels_equals_the_aten_one():
    """The whole model, prefill then decode steps, with ``TritonLayerOps`` and ``TritonAttention``
    (under the interpreter) against ATen's ops and the gathering attention, in float32."""
    from dataclasses import replace

    from fusedserve.coordinator.model_files.default_model import resolve_model
    from fusedserve.kernels.backend_table import aten, select_kernels
    from fusedserve.kernels.backend_table import triton as triton_backend
    from fusedserve.kernels.triton.layer_ops import TritonLayerOps
    from fusedserve.worker.model.qwen3 import Qwen3Model
    from tests.model_batches import decode_batch, prompt_batch

    outs = []
    for triton_ops in (False, True):
        model = Qwen3Model.from_pretrained(resolve_model("default:tiny"), dtype="float32")
        c = model.config
        # The loaded linear op is kept (the weights are packed for it); the layer ops and the
        # attention backend are what differ.
        base = select_kernels(c, torch.float32, CPU)
        if triton_ops:
            ops = TritonLayerOps(c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads)
        else:
            ops = TorchLayerOps(c.rms_norm_eps, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                c.head_dim, CPU)
        model.kernels = replace(base, ops=ops, backend=triton_backend if triton_ops else aten)
        assert model.kernels.attention_name == ("triton-paged" if triton_ops else "aten-gather")
        kv = model.new_kv_cache(num_blocks=16, block_size=4)
        ws = model.new_workspace(max_rows=16, block_size=4)
        logits = torch.empty(1, c.vocab_size)
        table = [9, 3, 14, 0, 7]
        ids = list(range(40, 53))
        steps = []
        model.forward(prompt_batch([ids[:9]], [table], 4), kv, ws, logits)
        steps.append(logits.clone())
        for p in range(9, len(ids)):
            model.forward(decode_batch([(ids[p], p, table)], 4), kv, ws, logits)
            steps.append(logits.clone())
        outs.append(torch.stack(steps))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=1e-4)


def test_cache_addresses_are_64_bit_in_the_compiled_kernels():
    """A slot times the slot stride passes 2^31 elements once a KV pool holds more than 2^31 /
    (heads x head_dim) tokens (2M tokens at 8 x 128: a 32 GB bf16 pool). Compiled for sm_90, every
    address into the KV pages is computed in int64: the attention kernels' K/V tiles, and the
    slot base where qk_norm_rope writes the cache."""
    code = (
        "import re\n"
        "from fusedserve.kernels.triton import aot_check as a\n"
        "j = a.jobs()\n"
        "for name in ('decode_attention_split_gqa4', 'decode_attention_split_gqa16',\n"
        "             'prompt_attention_16x16_bf16', 'qk_norm_rope'):\n"
        "    ir = a.compile_job(j[name]).asm['ttir']\n"
        "    if name == 'qk_norm_rope':  # its %k/%v are the qkv row's; the cache is written at a slot base\n"
        "        found = re.findall(r'= tt.addptr %[kv]_cache_ptr, .*', ir)\n"
        "    else:  # the K and V tiles the attention reads\n"
        "        found = re.findall(r'%[kv]_\\d+ = tt.addptr .*', ir)\n"
        "    print(name, len(found), sum('i64' in ln.split(' : ')[1] for ln in found))\n")
    for line in _compiled(["-c", code]).strip().splitlines():
        name, found, wide = line.split()
        assert int(found) >= 2 and found == wide, line  # K and V at least, every one 64-bit


def test_the_triton_sampler_draws_atens_tokens():
    """The every-stage sampler in Triton draws ``fusedserve.kernels.sampler``'s token on every row: greedy,
    the candidate path, the whole vocabulary with a top-k beyond the candidates, top-p placed
    among the candidates and top-p that needs the whole row, min-p; under the batch's plan and
    under each row's own (a row draws the same whatever its batch runs)."""
    from fusedserve.kernels.triton import sampler as triton_sampler
    from fusedserve.kernels.triton.self_check import sampler_batch

    rows, vocab, n = 40, 3000, 16
    logits, params, seeds = sampler_batch(rows, vocab, torch.Generator().manual_seed(5), CPU)
    t, top_p, _, k = params.T
    cand, full = sampler.row_paths(t, k, n)
    mass = torch.softmax(logits / torch.where(t > 0, t, 1)[:, None], -1).topk(n, -1).values.sum(-1)
    topp = full & (top_p < 1)
    # Both ways of placing the top-p cut, and a top-k beyond the candidates, are exercised.
    assert (topp & (mass >= top_p)).sum() >= 2 and (topp & (mass < top_p)).sum() >= 5
    assert (full & (k > n) & (k < vocab)).sum() >= 4 and cand.sum() >= 10 and (t == 0).sum() >= 4

    def draw(fn, rows_of, plan) -> torch.Tensor:
        out = torch.zeros(len(rows_of), dtype=torch.int32, device=DEV)
        fn(logits[rows_of].to(DEV), params[rows_of].to(DEV), seeds[rows_of].to(DEV), out, plan, n)
        return out.cpu()

    everything = list(range(rows))
    plan = sampler.SamplingPlan.for_rows(params.numpy(), n, vocab)
    assert plan.stages() == ["candidates", "full", "wide_top_k", "top_p", "min_p"]
    want = sampler.sample(logits, params, seeds, torch.zeros(rows, dtype=torch.int32), plan, n)
    got = draw(triton_sampler.sample, everything, plan)
    assert torch.equal(got, want), (got, want)
    assert torch.equal(got[t == 0], logits[t == 0].argmax(-1).int())
    assert len(set(got[t > 0].tolist())) > 20  # draws, not a constant
    for r in range(0, rows, 3):  # alone, under the row's own plan
        own = sampler.SamplingPlan.for_rows(params[r:r + 1].numpy(), n, vocab)
        assert draw(triton_sampler.sample, [r], own).item() == want[r].item(), (r, own)
    seeds[:, 1] += 1  # the next step draws anew, and still as ATen does
    again = draw(triton_sampler.sample, everything, plan)
    want = sampler.sample(logits, params, seeds, torch.zeros(rows, dtype=torch.int32), plan, n)
    assert torch.equal(again, want)
    assert (again != got).sum() >= 10


@pytest.mark.skipif(COMPILED, reason="on a GPU, tests/kernels/test_cuda.py runs the engine on these kernels")
def test_the_engine_samples_with_the_triton_sampler_as_with_atens():
    """The whole engine (scheduler, arena, decode-graph padding, seeded steps) with the Triton
    sampler under the interpreter draws the ATen sampler's tokens for requests on every path."""
    from dataclasses import replace

    from fusedserve.coordinator.engine.llm_engine import LLMEngine, load_model
    from fusedserve.coordinator.sampling_params import SamplingParams
    from fusedserve.kernels.triton import sampler as triton_sampler

    model, tok = load_model("default", "float32", "cpu", 128)
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, top_k=20),
             dict(temperature=1.0, min_p=0.05), dict(temperature=1.2, top_k=300, top_p=0.95)]
    params = [SamplingParams(max_tokens=6, seed=100 + i, ignore_eos=True, **kinds[i % 5]) for i in range(5)]
    prompts = ["The history of", "Once upon a time", "A list of", "Python is", "In the beginning"]
    outs = {}
    for name, fn in (("aten", sampler.sample), ("triton", triton_sampler.sample)):
        model.kernels = replace(model.kernels, sample=fn)
        engine = dict(max_batch=4, block_size=8, num_blocks=64, sampler_candidates=16, graphs="padded")
        with LLMEngine(model, **engine, tokenizer=tok) as eng:
            outs[name] = [o.token_ids for o in eng.generate(prompts, params)]
    assert outs["triton"] == outs["aten"]
    assert len({tuple(t) for t in outs["aten"]}) == 5


def test_the_self_check_passes_here_and_a_wrong_kernel_falls_back_to_aten(monkeypatch, caplog):
    """On CUDA the Triton backend is the default only once its kernels agree with torch on the
    device: here (the interpreter, or the GPU) they pass; a kernel that writes wrong values, or
    raises, fails the check, which warns and leaves ATen."""
    from fusedserve.kernels.backend_table import triton as backend
    from fusedserve.kernels.triton import self_check

    assert self_check.check(DEV) is None
    monkeypatch.setattr(self_check, "decode_attention", lambda *a, **k: a[7].zero_())
    assert "decode attention (torch.float32) is off by" in self_check.check(DEV)

    def broken(*a, **k):
        raise RuntimeError("PTX JIT failed")

    monkeypatch.setattr(self_check, "decode_attention", decode_attention)
    greedy = self_check.triton_sampler.sample
    monkeypatch.setattr(self_check.triton_sampler, "sample",
                        lambda lg, p, s, out, plan, n: greedy(lg, p, s, out, sampler.SamplingPlan(), n))
    assert "the sampler drew" in self_check.check(DEV)
    monkeypatch.setattr(self_check.triton_sampler, "sample", greedy)
    monkeypatch.setattr(self_check, "prompt_attention", broken)
    with caplog.at_level("WARNING"):
        assert backend.passes_self_check.__wrapped__(str(DEV)) is False
    assert "RuntimeError: PTX JIT failed" in caplog.text and "using ATen" in caplog.text
    monkeypatch.setenv("FUSEDSERVE_TRITON", "0")
    assert not backend.usable(torch.device("cuda"))  # forced off, whatever the check would say
