"""The engine on a CUDA GPU: captured decode graphs under every engine feature (device
sampling of every kind, async scheduling fed from device ids, prefix caching, chunked
prefill), the d2h contract, and the kernels against transformers. Skipped without a GPU;
the same features are tested on the CPU everywhere else."""

from __future__ import annotations

import pytest
import torch

from fusedserve.coordinator.engine.llm_engine import LLMEngine, load_model
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.sampler import sample, token_logprobs
from fusedserve.shared_memory.sampling_row import SamplingPlan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = ["The history of", "In the beginning", "Python is a", "Once upon a time there",
           "The function returns", "A list of"]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_model("default", "float32", "cuda", 128)


def _params(i: int) -> SamplingParams:
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, top_k=20),
             dict(temperature=1.0, min_p=0.05)]
    return SamplingParams(max_tokens=6 + 5 * (i % 4), seed=1000 + i, **kinds[i % 4],
                          logprobs=i % 3 == 0, top_logprobs=2 if i % 3 == 0 else 0,
                          stop=[" the"] if i % 5 == 1 else [])


def _run(model_and_tokenizer, **rc) -> tuple[list, LLMEngine]:
    model, tok = model_and_tokenizer
    runner = {"max_batch": 4, "block_size": 8, "num_blocks": 64, "sampler_candidates": 16, **rc}
    prompts = PROMPTS * 2  # repeats hit the prefix cache
    eng = LLMEngine(model, **runner, tokenizer=tok)
    try:
        eng.runtime.keep_history = 10_000
        outs = eng.generate(prompts, [_params(i) for i in range(len(prompts))])
    finally:
        eng.close()
    blocks = eng.core.scheduler.blocks
    assert blocks.num_used == 0, "every block is free or held by the cache only"
    blocks.flush()
    assert blocks.num_free == blocks.num_blocks
    return [(o.token_ids, o.text, o.finish_reason) for o in outs], eng


@pytest.mark.parametrize("rc", [{"async_scheduling": False}, {"enable_prefix_caching": False},
                                {"max_num_batched_tokens": 12}, {"graphs": "off"}],
                         ids=["sync", "no-prefix-cache", "chunked", "eager"])
def test_graphed_engine_agrees_with_each_feature_switched(model_and_tokenizer, rc):
    want, eng = _run(model_and_tokenizer)  # defaults: graphs, async, prefix cache, device sampling
    assert eng.runner.graphs is not None and eng.runner.graphs.graphs, "decode graphs captured"
    assert eng.core.stats.fed_rows > 0, "rows were fed ids the device kept"
    got, _ = _run(model_and_tokenizer, **rc)
    assert got == want
    assert any(o[2] == "stop" for o in got) and any(o[2] == "length" for o in got)


def test_d2h_per_decode_step_is_ids_and_asked_logprobs(model_and_tokenizer):
    _, eng = _run(model_and_tokenizer)
    decode = [r for r in eng.runtime.history if r.kind == "decode"]
    assert decode
    for r in decode:
        nl, n = r.dims["NL"], r.dims["N"]
        assert r.d2h_bytes == r.dims["B"] * 4 + nl * 4 + nl * n * 8


def test_seeded_rows_draw_the_same_alone_and_batched(model_and_tokenizer):
    model, tok = model_and_tokenizer
    params = [_params(i) for i in range(4)]
    with LLMEngine(model, **dict(max_batch=4, block_size=8, num_blocks=64, sampler_candidates=16),
                   tokenizer=tok) as eng:
        batched = [o.token_ids for o in eng.generate(PROMPTS[:4], params)]
        alone = [eng.generate([PROMPTS[i]], [params[i]])[0].token_ids for i in range(4)]
    assert batched == alone


@pytest.mark.parametrize("name", ["gqa2_untied", "gqa4_tied"])
def test_cuda_logits_match_transformers(hf_checkpoints, name):
    from transformers import Qwen3ForCausalLM

    path = hf_checkpoints[name]
    hf = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, hf.config.vocab_size, (1, 19), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    model, _ = load_model(path, "float32", "cuda", 64)
    rc = dict(max_batch=2, block_size=4, num_blocks=32, sampler_candidates=8)
    with LLMEngine(model, **rc) as eng:
        eng.generate([ids[0, :11].tolist()], SamplingParams(max_tokens=1))
        logits = eng.runner.logits[0].cpu()  # the prefill's last row
    torch.testing.assert_close(logits, ref[10], atol=2e-4, rtol=1e-4)


PLANS = [SamplingPlan(), SamplingPlan(candidates=True),
         SamplingPlan(candidates=True, full=True, wide_top_k=True, top_p=True, min_p=True)]


def _sampler_inputs(b: int = 8, vocab: int = 4096):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(b, vocab, device="cuda", generator=g) * 3
    params = torch.tensor([[0.0, 1.0, 0.0, 0], [0.8, 0.9, 0.0, 20], [1.0, 0.95, 0.0, 0], [0.7, 1.0, 0.05, 0],
                           [1.2, 0.5, 0.0, 100], [0.9, 1.0, 0.0, 64], [1.0, 1.0, 0.0, 0], [0.5, 0.8, 0.1, 5]],
                          device="cuda")[:b]
    seeds = torch.stack([torch.arange(b), torch.full((b,), 3)], 1).cuda()
    return logits, params, seeds


def _sampler(name: str):
    """ATen's sampler, or the Triton one (imported here: importing triton at collection would keep
    tests/kernels/test_triton_kernels.py from choosing its interpreter)."""
    if name == "aten":
        return sample
    pytest.importorskip("triton")
    from fusedserve.kernels.triton.sampler import sample as triton_sample

    return triton_sample


@pytest.mark.parametrize("which", ["aten", "triton"])
@pytest.mark.parametrize("plan", PLANS, ids=["greedy", "candidates", "everything"])
def test_the_sampler_never_synchronizes_with_the_host(plan, which):
    sample = _sampler(which)
    logits, params, seeds = _sampler_inputs()
    out = torch.empty(8, dtype=torch.int32, device="cuda")
    lp, ids, vals = (torch.empty(8, device="cuda"), torch.empty(8, 5, dtype=torch.int32, device="cuda"),
                     torch.empty(8, 5, device="cuda"))
    sample(logits, params, seeds, out, plan, 64)  # warm-up: first calls may load kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device -> host read raises
    try:
        sample(logits, params, seeds, out, plan, 64)
        token_logprobs(logits, out, lp, ids, vals)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(RuntimeError):  # the check can fail: a host read does
        torch.cuda.set_sync_debug_mode("error")
        try:
            bool((logits > 0).any())
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("which", ["aten", "triton"])
def test_the_sampler_is_captured_in_a_cuda_graph_and_replays_exactly(which):
    sample = _sampler(which)
    logits, params, seeds = _sampler_inputs()
    plan = PLANS[-1]
    eager = torch.empty(8, dtype=torch.int32, device="cuda")
    sample(logits, params, seeds, eager, plan, 64)
    out = torch.empty(8, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample(logits, params, seeds, out, plan, 64)  # warm up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample(logits, params, seeds, out, plan, 64)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    seeds[:, 1] += 1  # the next step: new inputs in place, the same graph
    graph.replay()
    sample(logits, params, seeds, eager, plan, 64)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("triton", ["0", "1"], ids=["aten", "triton"])
def test_a_decode_step_is_one_replay_with_the_sampler_and_no_host_sync(monkeypatch, triton):
    """A decode launch's step (feed, replay, sampling) never waits on the device, and sampling adds no
    kernel launch outside the replay: a greedy and a sampled launch launch the same eager kernels."""
    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    from fusedserve.benchmarks.decode_step import bench_runner, greedy_batch, launch

    if triton == "1":
        pytest.importorskip("triton")
    monkeypatch.setenv("FUSEDSERVE_TRITON", triton)
    model, _ = load_model("default", "bfloat16", "cuda", 128)
    cfg, arena, runner = bench_runner(model, "onegraph", max_batch=8, block_size=16, num_blocks=64,
                                      sampler_candidates=16)
    try:
        step = runner._step

        def checked(v, desc):
            torch.cuda.set_sync_debug_mode("error")
            try:
                step(v, desc)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        runner._step = checked
        tables = np.arange(8 * 4, dtype=np.int32).reshape(8, 4)
        launches = {}
        for kind in ("greedy", "sampled"):
            batch = greedy_batch(tables[:6], 20, 16)
            if kind == "sampled":
                for seq in batch.seqs:
                    seq.params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=1 << 30)
            desc = launch(arena, batch, 0, cfg, model.config.vocab_size)
            runner.execute(desc)  # warm
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                runner.execute(desc)
            launches[kind] = sum(e.count for e in prof.key_averages() if e.key == "cudaLaunchKernel")
            assert any(e.key == "cudaGraphLaunch" for e in prof.key_averages())
        assert launches["sampled"] == launches["greedy"], launches
    finally:
        arena.close()


def test_the_triton_sampler_draws_atens_tokens_on_the_gpu():
    """The Triton sampler against ATen's on the device, rows on every path (a probability may
    differ in its last bit between the two, so one boundary draw in 40 is allowed)."""
    pytest.importorskip("triton")
    from fusedserve.kernels.triton.self_check import sampler_mismatches

    assert sampler_mismatches(torch.device("cuda"), rows=40, vocab=151_936, candidates=64) <= 1


def test_the_arena_banks_are_page_locked_and_a_launch_waits_on_its_own_event(model_and_tokenizer,
                                                                             monkeypatch):
    """Every bank is registered with CUDA (its copies are DMA, non-blocking on the launch's
    stream) and no launch calls ``torch.cuda.synchronize``; the tokens are the same."""
    want, _ = _run(model_and_tokenizer)
    model, tok = model_and_tokenizer

    def forbidden(*a, **k):
        raise AssertionError("a launch synchronized the whole device")

    runner = dict(max_batch=4, block_size=8, num_blocks=64, sampler_candidates=16)
    with LLMEngine(model, **runner, tokenizer=tok) as eng:
        assert eng.runner.runtime.pinning.pinned == len(eng.arenas) >= 2
        monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
        got = eng.generate(PROMPTS * 2, [_params(i) for i in range(len(PROMPTS) * 2)])
        monkeypatch.undo()
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == want
    assert eng.runner.runtime.pinning.pinned == 0  # released at close, before the banks unmap


def test_the_triton_kernels_run_the_engine_as_aten_does(monkeypatch):
    """``FUSEDSERVE_TRITON=1``: the Triton layer ops and paged attention (kernels/triton/) give the
    ATen path's greedy tokens, in float32, under the same graphs and async scheduling."""
    pytest.importorskip("triton")
    runner = dict(max_batch=4, block_size=8, num_blocks=64, sampler_candidates=16)
    params = [SamplingParams(max_tokens=24, ignore_eos=True) for _ in PROMPTS]
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FUSEDSERVE_TRITON", flag)
        model, tok = load_model("default", "float32", "cuda", 128)
        assert (model.kernels.name == "triton") == (flag == "1")
        with LLMEngine(model, **runner, tokenizer=tok) as eng:
            outs[flag] = [o.token_ids for o in eng.generate(PROMPTS, params)]
    assert outs["1"] == outs["0"]


def test_moe_grouped_gemms_match_the_per_expert_path_without_host_syncs(moe_dir, monkeypatch):
    """Qwen3-MoE on CUDA: the grouped-GEMM layer (torch._grouped_mm) against one GEMM per expert,
    and a decode forward through it reads nothing back to the host."""
    from fusedserve.kernels import backend_table
    from fusedserve.worker.model.qwen3 import Qwen3Model
    from tests.model_batches import decode_batch, prompt_batch

    def logits(grouped: bool) -> tuple[torch.Tensor, Qwen3Model]:
        monkeypatch.setattr(backend_table, "_grouped_mm_runs", lambda *a: grouped)
        model = Qwen3Model.from_pretrained(moe_dir, dtype="bfloat16", device="cuda")
        assert model.kernels.grouped_moe == grouped
        kv = model.new_kv_cache(num_blocks=16, block_size=4)
        ws = model.new_workspace(max_rows=4, block_size=4)
        out = torch.empty(3, 320, device="cuda")
        prompts, tables = [[5, 17, 42, 99, 3], [250, 1, 8], [77] * 6], [[0, 1], [2], [3, 4]]
        model.forward(_on_cuda(prompt_batch(prompts, tables, 4)), kv, ws, out)
        step = _on_cuda(decode_batch([(7, 5, [0, 1]), (9, 3, [2, 5]), (11, 6, [3, 4])], 4))
        torch.cuda.synchronize()
        if grouped:
            torch.cuda.set_sync_debug_mode("error")
        try:
            model.forward(step, kv, ws, out)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return out.cpu(), model

    grouped, _ = logits(True)
    loop, _ = logits(False)
    assert torch.equal(grouped.argmax(-1), loop.argmax(-1))
    torch.testing.assert_close(grouped, loop, atol=5e-2, rtol=5e-2)


def _on_cuda(batch):
    from dataclasses import fields, replace

    return replace(batch, **{f.name: getattr(batch, f.name).cuda() for f in fields(batch)
                             if isinstance(getattr(batch, f.name), torch.Tensor)})


def test_triton_bf16_logits_are_no_further_from_fp32_than_atens(monkeypatch):
    """The issue's numeric bound: with bf16 weights, the Triton path's logits stay as close to the
    float32 ATen logits as the ATen path's bf16 logits are (prefill, then decode steps)."""
    pytest.importorskip("triton")
    from fusedserve.coordinator.model_files.default_model import resolve_model
    from fusedserve.worker.model.qwen3 import Qwen3Model
    from tests.model_batches import decode_batch, prompt_batch

    def logits(dtype: str, triton: str) -> torch.Tensor:
        monkeypatch.setenv("FUSEDSERVE_TRITON", triton)
        model = Qwen3Model.from_pretrained(resolve_model("default"), dtype=dtype, device="cuda",
                                           max_model_len=128)
        kv = model.new_kv_cache(num_blocks=16, block_size=8)
        ws = model.new_workspace(max_rows=16, block_size=8)
        out = torch.empty(1, model.config.vocab_size, device="cuda")
        table, ids, steps = [3, 9, 1], list(range(40, 60)), []
        model.forward(_on_cuda(prompt_batch([ids[:12]], [table], 8)), kv, ws, out)
        steps.append(out.clone())
        for p in range(12, len(ids)):
            model.forward(_on_cuda(decode_batch([(ids[p], p, table)], 8)), kv, ws, out)
            steps.append(out.clone())
        return torch.stack(steps).cpu()

    ref = logits("float32", "0")
    aten, triton = logits("bfloat16", "0"), logits("bfloat16", "1")
    err_aten, err_triton = (aten - ref).abs().max().item(), (triton - ref).abs().max().item()
    assert err_triton <= 1.25 * err_aten + 1e-3, (err_aten, err_triton)
