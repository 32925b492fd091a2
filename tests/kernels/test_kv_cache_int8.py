"""``kv_cache_dtype="int8"``: each head row of a token as int8 values and a float32 scale.

The cache write quantizes exactly as specified (symmetric, round-half-even, one scale per token
and head), the native decode and prompt kernels compute on the dequantized values (float64
references over them), rows stay independent of their batch, and an engine on such a cache
holds about twice the tokens, serves the same tokens whatever the chunking and prefix reuse,
and scores a prompt close to the 16-bit cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusedserve.coordinator.engine import kv_sizing
from fusedserve.coordinator.engine.config_resolution import resolve_config
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.kv_cache import KV8_SCALE_BYTES, dequantize_rows
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.kernels.native import build as native
from fusedserve.shared_memory.engine_config import CacheConfig, EngineConfig
from tests.kernels.test_native_kernels import ISAS, _module, _paged, needs_native


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> int8 [..., D + 4] as the native cache write stores it: s = max|x| / 127 in
    float32 (1 for a zero row), q = round_half_even(x * (1 / s)), then s's 4 bytes."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(xf * (1 / s)).clamp(-127, 127).to(torch.int8)
    return torch.cat([q, s.contiguous().view(torch.int8)], -1)


def _pages(lens: list[int], bs: int, kvh: int, hd: int, g: torch.Generator):
    """``_paged``'s scattered pages, quantized; per-head magnitudes vary (scales differ)."""
    kc, vc, tables, bt = _paged(lens, bs, kvh, hd, torch.float32, g)
    mag = torch.rand(kc.shape[0], kvh, 1, generator=g) * 4 + 0.1
    return quantize_rows(kc * mag), quantize_rows(vc * mag), tables, bt


def _deq64(rows: torch.Tensor) -> torch.Tensor:
    d = rows.shape[-1] - KV8_SCALE_BYTES
    return rows[..., :d].double() * rows[..., d:].contiguous().view(torch.float32).double()


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_write_stores_each_head_row_quantized_with_its_scale(isa, dtype):
    from fusedserve.kernels.layer_ops import NormScratch, rope_tables
    from fusedserve.kernels.native.backend import NativeLayerOps

    m = _module(isa)
    g = torch.Generator().manual_seed(1)
    n, h, kvh, hd = 6, 4, 2, 32
    qkv = (torch.randn(n, (h + 2 * kvh) * hd, generator=g) * 3).to(dtype)
    qkv[2, (h + kvh) * hd : (h + kvh + 1) * hd] = 0  # a zero V row: codes 0, scale 1
    qw, kw = (1 + 0.1 * torch.randn(2, hd, generator=g)).to(dtype)
    cos, sin = (t[torch.tensor([0, 3, 7, 63, 20, 5])] for t in rope_tables(hd, 10000.0, 64, dtype))
    slots = torch.tensor([9, 2, 14, 0, 5, 11])
    ops = NativeLayerOps(m, 1e-6, h, kvh)
    ref_k, ref_v = torch.zeros(16, kvh, hd, dtype=dtype), torch.zeros(16, kvh, hd, dtype=dtype)
    q_ref = torch.empty(n, h, hd, dtype=dtype)
    scratch = NormScratch.allocate(n, 64, h, kvh, hd, dtype, "cpu")
    ops.qk_norm_rope(qkv.clone(), qw, kw, cos, sin, q_ref, scratch, ref_k, ref_v, slots)
    kc = torch.full((16, kvh, hd + KV8_SCALE_BYTES), 3, dtype=torch.int8)
    vc = kc.clone()
    q_out = torch.empty(n, h, hd, dtype=dtype)
    ops.qk_norm_rope(qkv.clone(), qw, kw, cos, sin, q_out, scratch, kc, vc, slots)
    assert torch.equal(q_out, q_ref), "the queries do not depend on the cache's dtype"
    assert torch.equal(kc[slots], quantize_rows(ref_k[slots]))
    assert torch.equal(vc[slots], quantize_rows(ref_v[slots]))
    assert not vc[slots[2], 0, :hd].any() and dequantize_rows(vc[slots[2]], torch.float32)[0].eq(0).all()
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert kc[untouched].eq(3).all() and vc[untouched].eq(3).all(), "no other slot is written"
    # Each value within half a step of its scale, the extreme exact.
    x, deq = ref_k[slots].double(), _deq64(kc[slots])
    step = kc[slots][..., hd:].contiguous().view(torch.float32).double()
    assert ((deq - x).abs() <= step / 2 * (1 + 1e-6) + 1e-7).all()


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,h", [(torch.float32, 8), (torch.bfloat16, 8), (torch.bfloat16, 6)])
def test_decode_attention_over_int8_pages_matches_float64_on_the_dequantized_values(isa, dtype, h):
    """GQA 4 (a compiled group size) and 3 (the generic loop)."""
    m = _module(isa)
    g = torch.Generator().manual_seed(2)
    kvh, hd, bs = 2, 32, 4
    lens = [1, 5, 33, 70, 513, 1100]  # block tails, several softmax chunks, past one work item
    kc, vc, tables, bt = _pages(lens, bs, kvh, hd, g)
    q = torch.randn(len(lens), h, hd, generator=g).to(dtype)
    out = torch.empty_like(q)
    m.decode_attention(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32), bs, hd**-0.5, out)
    for i, n in enumerate(lens):
        idx = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(n)])
        k, v = _deq64(kc[idx]).transpose(0, 1), _deq64(vc[idx]).transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i].double().unsqueeze(1), k, v, enable_gqa=True).squeeze(1)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i].double(), ref, atol=tol * v.abs().max().item(), rtol=tol)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_decode_attention_over_int8_pages_does_not_depend_on_the_batch_or_the_threads(isa):
    m = _module(isa)
    g = torch.Generator().manual_seed(4)
    lens, bs = [1300, 7, 513, 2050], 16
    kc, vc, _, bt = _pages(lens, bs, 2, 64, g)
    q = torch.randn(len(lens), 8, 64, generator=g).bfloat16()
    sl = torch.tensor(lens, dtype=torch.int32)
    full = torch.empty_like(q)
    m.decode_attention(q, kc, vc, bt, sl, bs, 0.125, full)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for i in range(len(lens)):
                alone = torch.empty_like(q[i : i + 1])
                m.decode_attention(q[i : i + 1], kc, vc, bt[i : i + 1], sl[i : i + 1], bs, 0.125, alone)
                assert torch.equal(alone, full[i : i + 1]), (t, lens[i])
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("flash", [True, False])
def test_prompt_chunks_over_int8_pages_match_float64_on_the_bf16_dequantized_values(flash):
    """The flash kernel (AVX-512 BF16 builds) and the SDPA path (``prompt_rows``) both read an
    int8 page as q * scale rounded to the query's dtype."""
    from fusedserve.kernels.attention.prompt_rows import PromptChunk, attend_chunks

    m = native.kernels()
    if flash and not m.has_prompt_attention():
        pytest.skip("prompt_attention needs an AVX-512 BF16 build")
    g = torch.Generator().manual_seed(5)
    heads, kvh, d, bs = 8, 2, 64, 4
    spec = [(5, 5), (1, 1), (3, 40), (70, 70), (33, 101)]  # (queries, context)
    kc, vc, tables, bt = _pages([ctx for _, ctx in spec], bs, kvh, d, g)
    rows = sum(n for n, _ in spec) + 1  # row 0: a decode row's, left alone
    q = torch.randn(rows, heads, d, generator=g).bfloat16()
    out = torch.full((rows, heads, d), 7.0).bfloat16()
    chunks, slots, start = [], [], 1
    for i, (n, ctx) in enumerate(spec):
        chunks.append([i, start, n, ctx])
        slots.append(torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(ctx)]))
        start += n
    if flash:
        m.prompt_attention(q, kc, vc, bt, torch.tensor(chunks, dtype=torch.int64), bs, d**-0.5, out)
    else:
        attend_chunks([PromptChunk(s, s + n, sl) for (_, s, n, _), sl in zip(chunks, slots)], q, kc, vc,
                      out, d**-0.5)
    assert torch.equal(out[0], torch.full((heads, d), 7.0).bfloat16())
    for (_, s, n, ctx), sl in zip(chunks, slots):
        k = dequantize_rows(kc[sl], torch.bfloat16).double().repeat_interleave(heads // kvh, 1)
        v = dequantize_rows(vc[sl], torch.bfloat16).double().repeat_interleave(heads // kvh, 1)
        scores = torch.einsum("nhd,chd->hnc", q[s : s + n].double(), k) * d**-0.5
        visible = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
        ref = torch.einsum("hnc,chd->nhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
        err = (out[s : s + n].double() - ref).abs()
        assert (err <= 2**-8 * ref.abs() + 4e-3 * v.abs().max()).all(), err.max()


def test_an_int8_cache_holds_a_byte_per_value_and_a_scale_per_head_row():
    c = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=28,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)
    assert kv_sizing.bytes_per_token(c, torch.bfloat16, 1, "int8") == 28 * 2 * 8 * (128 + 4)
    assert kv_sizing.bytes_per_token(c, torch.bfloat16, 2, "int8") == 28 * 2 * 4 * (128 + 4)
    args = dict(device_kind="cpu", max_batch=64, max_model_len=1024, weight_bytes=0, ranks_on_node=1, tp=1)
    auto = kv_sizing.plan(c, torch.bfloat16, CacheConfig(16, kv_cache_memory=1 << 30), **args)
    int8_cache = CacheConfig(16, kv_cache_memory=1 << 30, kv_cache_dtype="int8")
    int8 = kv_sizing.plan(c, torch.bfloat16, int8_cache, **args)
    assert int8.num_blocks == (1 << 30) // (16 * 28 * 2 * 8 * 132) and int8.num_blocks > 1.9 * auto.num_blocks
    assert int8.describe().startswith("KV cache (int8): ") and auto.describe().startswith("KV cache: ")


def test_the_serve_flag_reaches_the_cache_config():
    from fusedserve.coordinator.cli_parser import build_parser, server_config

    assert server_config(build_parser().parse_args(["serve"])).engine.cache.kv_cache_dtype == "auto"
    cfg = server_config(build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"]))
    assert cfg.engine.cache.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])


def test_an_unknown_kv_dtype_and_int8_off_the_cpu_are_refused(hf_checkpoints):
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or int8"):
        EngineConfig.build(kv_cache_dtype="fp8").check()
    cfg = EngineConfig.build(model=str(hf_checkpoints["gqa2_untied"]), kv_cache_dtype="int8", num_blocks=8)
    with pytest.raises(ValueError, match="native CPU kernels"):
        resolve_config(cfg, "cuda")
    assert resolve_config(cfg, "cpu").config.cache.kv_cache_dtype == "int8"


@needs_native
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_engine_on_an_int8_cache_serves_the_same_tokens_however_its_prompts_are_split(hf_checkpoints,
                                                                                          dtype):
    """Whole prompts, 8-token chunks, and a second pass over prefix-cached blocks give the same
    greedy tokens; the prompts' logprobs, and the sampled ones' up to where greedy paths part, stay
    close to a 16-bit cache's (and are not the same)."""
    path = hf_checkpoints["gqa2_untied"]
    prompts = [[(7 * i + 3 * j) % 380 + 1 for j in range(n)] for i, n in enumerate((40, 23, 57))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, prompt_logprobs=0)
    base = dict(dtype=dtype, max_batch=4, block_size=4, num_blocks=96)
    runs = {}
    for name, extra in (("whole", {}), ("chunked", dict(max_num_batched_tokens=12))):
        with LLMEngine(path, kv_cache_dtype="int8", **base, **extra) as eng:
            assert eng.runner.kv.data.dtype == torch.int8
            runs[name] = eng.generate(prompts, params)
            runs[name + "-cached"] = eng.generate(prompts, params)
    with LLMEngine(path, **base) as eng:
        ref = eng.generate(prompts, params)
    for name, outs in runs.items():
        assert [o.token_ids for o in outs] == [o.token_ids for o in runs["whole"]], name
    diffs = torch.tensor([abs(a - b) for o, r in zip(runs["whole"], ref)
                          for a, b in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:])])
    assert 0 < diffs.mean() < 0.04 and diffs.max() < 0.25, (diffs.mean(), diffs.max())
    # Decoding: the sampled tokens' logprobs close too, up to where the greedy paths part.
    same = []
    for o, r in zip(runs["whole"], ref, strict=True):
        for ta, a, tb, b in zip(o.token_ids, o.logprobs, r.token_ids, r.logprobs, strict=True):
            if ta != tb:
                break
            same.append(abs(a - b))
    assert len(same) >= 12 and max(same) < 0.25, same
