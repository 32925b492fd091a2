"""Paged attention, batched decode and the decode step's allocation-freedom."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from fusedserve.kernels.aten.backend import AttentionScratch, paged_decode_attention
from fusedserve.worker.model.qwen3 import Qwen3Model
from tests.model_batches import decode_batch, prompt_batch


def test_paged_attention_over_scattered_blocks_equals_dense():
    torch.manual_seed(0)
    b, h, kvh, hd, bs, nblocks = 3, 8, 2, 16, 4, 40
    lens = [5, 13, 1]
    k_cache = torch.randn(nblocks * bs, kvh, hd)
    v_cache = torch.randn(nblocks * bs, kvh, hd)
    perm = torch.randperm(nblocks).tolist()
    tables = [perm[0:2], perm[10:14], perm[30:31]]  # non-contiguous, unordered
    width = max(len(t) for t in tables)
    bt = torch.zeros(b, width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    q = torch.randn(b, h, hd)
    scratch = AttentionScratch(4, 32, h, kvh, hd, bs, torch.float32)
    slots, mask = scratch.prepare(bt, torch.tensor(lens, dtype=torch.int32), width * bs)
    out = torch.empty(b, h, hd)
    paged_decode_attention(q, k_cache, v_cache, slots, mask, hd**-0.5, scratch, out)
    for i, n in enumerate(lens):
        idx = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(n)])
        k = k_cache[idx].transpose(0, 1)  # [kvh, n, hd]
        v = v_cache[idx].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i].unsqueeze(1), k, v, enable_gqa=True)  # [h,1,hd]
        torch.testing.assert_close(out[i], ref.squeeze(1), atol=1e-5, rtol=1e-5)


def _prefill_one(model, kv, ws, logits, ids, table, bs):
    model.forward(prompt_batch([ids], [table], bs), kv, ws, logits)
    return logits[0].argmax().item()


def test_batched_decode_equals_each_alone(hf_checkpoints):
    model = Qwen3Model.from_pretrained(hf_checkpoints["gqa4_tied"], dtype="float32")
    bs = 4
    prompts = [[1, 2, 3], list(range(10, 27)), [200]]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13]]

    def run(indices):
        kv = model.new_kv_cache(16, bs)
        ws = model.new_workspace(4, bs)
        out = torch.empty(4, model.config.vocab_size)
        state = []
        for i in indices:
            state.append([_prefill_one(model, kv, ws, out, prompts[i], tables[i], bs), len(prompts[i])])
        logits = []
        for _ in range(6):
            batch = decode_batch([(t, p, tables[i]) for (t, p), i in zip(state, indices)], bs)
            model.forward(batch, kv, ws, out[: len(indices)])
            logits.append(out[: len(indices)].clone())
            for r, st in enumerate(state):
                st[0], st[1] = out[r].argmax().item(), st[1] + 1
        return torch.stack(logits, 1)  # [rows, steps, vocab]

    batched = run([0, 1, 2])
    for i in range(3):
        torch.testing.assert_close(batched[i], run([i])[0], atol=1e-5, rtol=1e-5)


def test_decode_step_allocates_nothing_after_warmup(hf_checkpoints):
    from fusedserve.kernels.native import build as native

    kinds = [("float32", None), ("bfloat16", None), ("bfloat16", "int8")]
    if native.kernels() is not None:
        kinds.append(("bfloat16", "int4"))  # int4 runs on the native kernels only
    for dtype, quantization in kinds:
        model = Qwen3Model.from_pretrained(hf_checkpoints["gqa2_untied"], dtype=dtype,
                                           quantization=quantization)
        bs = 4
        kv = model.new_kv_cache(16, bs)
        ws = model.new_workspace(4, bs)
        out = torch.empty(4, model.config.vocab_size)
        table = [3, 1, 7]
        _prefill_one(model, kv, ws, out, [4, 5, 6, 7, 8], table, bs)
        batch = decode_batch([(9, 5, table), (9, 5, table)], bs)
        model.forward(batch, kv, ws, out[:2])  # warm-up
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model.forward(batch, kv, ws, out[:2])
        allocs = [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0]
        assert allocs == [], f"{dtype} {quantization}: a decode forward allocated {allocs[:10]}"
        # The profiler sees allocations at all (guards against a check that cannot fail).
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            torch.empty(1000)
        assert any(e.cpu_memory_usage > 0 for e in prof.events())


def test_the_decode_step_benchmark_runs_and_counts_ids_only(monkeypatch):
    """``fusedserve.benchmarks.decode_step.run`` (which cuda_peers, tp_decode and moe_decode call) runs the
    real launch path end to end on the embedded model; its byte counts are the launch reply's:
    4 bytes of ids back per row."""
    from fusedserve.benchmarks import decode_step
    from fusedserve.coordinator.model_files.default_model import resolve_model

    for probe in ("read_bandwidth", "copy_bandwidth"):  # seconds each: not what this checks
        monkeypatch.setattr(decode_step, probe, lambda *a, **k: 1e10)
    model = str(resolve_model("default"))
    res = decode_step.run([1, 3], context=8, steps=3, dtype="float32", model_dir=model)
    assert [r["batch"] for r in res["rows"]] == [1, 3]
    assert [r["d2h_bytes"] for r in res["rows"]] == [4, 12] and all(r["h2d_bytes"] > 0 for r in res["rows"])


def test_the_gpu_peers_benchmark_runs_end_to_end_on_the_cpu(monkeypatch, tmp_path):
    """``fusedserve.benchmarks.cuda_peers.measure`` on the CPU with the embedded model: every engine and both
    decode-step settings give figures and no error, and the JSON is written as cases end (what a
    lent GPU's first run must not lose to an API drift)."""
    import json

    from fusedserve.benchmarks import cuda_peers, decode_step
    from fusedserve.coordinator.model_files.default_model import resolve_model

    for probe in ("read_bandwidth", "copy_bandwidth"):
        monkeypatch.setattr(decode_step, probe, lambda *a, **k: 1e10)
    out = tmp_path / "peers.json"
    res = cuda_peers.measure([2], 8, 4, str(out), device="cpu", model_dir=resolve_model("default"))
    assert res["errors"] == {}, res["errors"]
    assert set(res["results"]) == {"fusedserve-bf16", "transformers-bf16"}
    assert all(row[2]["median"] > 0 for row in res["results"].values())
    assert set(res["steps"]) == {"auto", "off"} and json.loads(out.read_text())["results"]
    assert any("fusedserve / transformers" in line for line in cuda_peers.table(res))


def test_the_gpu_profile_runs_its_cases_on_the_cpu(monkeypatch):
    """``fusedserve.benchmarks.cuda_profile.profile_model`` on the embedded model on the CPU (graphs' padded
    eager twins, wall time, ATen ops counted): every figure of every case, greedy and sampled, is
    there; the profiler's op names are what per-layer counts come from."""
    from fusedserve.benchmarks import cuda_profile
    from fusedserve.coordinator.model_files.default_model import resolve_model
    from fusedserve.worker.model.qwen3 import Qwen3Model

    model = Qwen3Model.from_pretrained(resolve_model("default"), "float32", "cpu", max_model_len=80)
    rows = cuda_profile.profile_model(model, [(1, 16), (3, 40)], calls=2, read_bw=1e10)
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 16), (3, 40)]
    for r in rows:
        assert r["replay_ms"] > 0 and r["sampled_replay_ms"] > 0 and r["launch_ms"] > 0
        assert r["launch_minus_replay_ms"] == r["launch_ms"] - r["replay_ms"]
        layers = model.config.num_hidden_layers
        assert abs(sum(r["kernels_per_layer_by_name"].values()) * layers - r["kernels_per_replay"]) < 1e-9
        assert r["kernels_per_replay"] > 0


def test_the_report_names_the_host_isa_and_amx(monkeypatch):
    """Sections re-run alone carry their host: its vector extensions, and AMX present or not."""
    from fusedserve.benchmarks import common

    monkeypatch.setattr(common, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16", "avx_vnni"})
    assert common.isa_line() == "AVX-512 BF16, AVX-512, AVX-VNNI, AVX2; no AMX"
    monkeypatch.setattr(common, "cpu_flags", lambda: {"avx2", "amx_tile", "amx_bf16", "amx_int8"})
    assert common.isa_line() == "AMX-BF16, AMX-INT8, AVX2; AMX"


def test_the_prefill_split_accounts_every_kernel_call_and_its_flops():
    """``fusedserve.benchmarks.prefill_parts`` on the tiny embedded model: every layer's four GEMMs and its
    attention are timed once a launch, the GEMM flops are the model's own (2 x tokens x each
    projection's K x N, lm_head for the one last token), the parts add up to the wall time, and
    the kernels' own methods come back afterwards."""
    from fusedserve.benchmarks import prefill_parts
    from fusedserve.coordinator.model_files.default_model import default_model_dir
    from fusedserve.kernels.linear import LinearOp

    call = LinearOp.__call__
    tokens = 40
    res = prefill_parts.measure(tokens, runs=3, preset="tiny")
    cfg = json.loads((default_model_dir("tiny") / "config.json").read_text())
    d, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd, h, kvh = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    per_token = d * (h + 2 * kvh) * hd + h * hd * d + d * 2 * inter + inter * d
    assert res["calls"] == {"GEMMs": 4 * layers + 1, "attention": layers, "fused ops": 4 * layers + 1,
                            "rest": 0}
    assert res["flop"]["GEMMs"] == 2 * (tokens * layers * per_token + d * cfg["vocab_size"])
    assert res["flop"]["attention"] == 4 * h * hd * layers * tokens * (tokens + 1) / 2
    med = {p: res["seconds"][p]["median"] for p in (*prefill_parts.PARTS, "total")}
    assert all(med[p] > 0 for p in ("GEMMs", "attention", "fused ops", "total"))
    assert sum(med[p] for p in prefill_parts.PARTS) == pytest.approx(med["total"], rel=0.2)
    assert LinearOp.__call__ is call


def _fake_batched_bench(folder: Path, total_s: float) -> None:
    """A ``llama-batched-bench`` in ``folder``/bin that prints one row per batch of ``-npl``, each
    batch's whole run taking ``total_s``: which build ran shows in the tokens/s."""
    binary = folder / "bin" / "llama-batched-bench"
    binary.parent.mkdir(parents=True)
    binary.write_text(
        "#!/bin/sh\n"
        "while [ $# -gt 0 ]; do [ \"$1\" = -npl ] && npl=$2; shift; done\n"
        "for b in $(echo $npl | tr , ' '); do\n"
        f"  echo \"| 8 | 4 | $b | 96 | 0.1 | 80.0 | 0.2 | 20.0 | {total_s} | 1.0 |\"\n"
        "done\n")
    binary.chmod(0o755)


def test_llama_cpp_runs_q8_0_and_q4_0_from_its_amx_off_build_on_an_amx_cpu(monkeypatch, tmp_path):
    """llama.cpp's Q8_0 and Q4_0 crash in its AMX path: on a CPU with AMX the native comparison
    runs them from ``build-noamx`` (bf16 stays on the native build), the result names each
    engine's build, and a CPU without AMX runs all three from the native build."""
    from fusedserve.benchmarks import cpu_peers, llama_cpp
    from fusedserve.coordinator.model_files.default_model import default_model_dir

    amx = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
    assert llama_cpp.build_for("llamacpp-q8_0", "native", amx) == "build-noamx"
    assert llama_cpp.build_for("llamacpp-q4_0", "native", amx) == "build-noamx"
    assert llama_cpp.build_for("llamacpp-bf16", "native", amx) == "build"
    assert llama_cpp.build_for("llamacpp-q8_0", "avx2", amx) == "build-avx2"
    assert llama_cpp.build_for("llamacpp-q8_0", "native", amx - {"amx_tile"}) == "build"

    _fake_batched_bench(tmp_path / "build", 1.0)
    _fake_batched_bench(tmp_path / "build-noamx", 2.0)
    monkeypatch.setattr(cpu_peers, "default_model_dir", lambda preset: default_model_dir("tiny"))
    monkeypatch.setattr(cpu_peers, "read_bandwidth", lambda: 1e10)
    monkeypatch.setattr(llama_cpp, "gguf", lambda *a: tmp_path / f"{a[-1]}.gguf")
    engines = ["llamacpp-bf16", "llamacpp-q8_0", "llamacpp-q4_0"]
    for flags, slow in ((amx, {"llamacpp-q8_0", "llamacpp-q4_0"}), (amx - {"amx_tile"}, set())):
        monkeypatch.setattr(cpu_peers, "cpu_flags", lambda flags=flags: flags)
        res = cpu_peers.measure(engines, [1, 4], 8, 4, 2, None, llama_dir=str(tmp_path))
        for e in engines:  # B x 4 new tokens over the fake's total seconds
            secs = 2.0 if e in slow else 1.0
            assert cpu_peers.medians(res)[e] == {1: 4 / secs, 4: 16 / secs}
            assert res["llama_builds"][e].startswith("build-noamx (" if e in slow else "build (")
    assert cpu_peers.llama_builds(res) == "`build` (GGML_NATIVE=ON) for bf16, Q8_0, Q4_0"
    res["llama_builds"] = {"llamacpp-bf16": "build (GGML_NATIVE=ON)",
                           "llamacpp-q8_0": "build-noamx (GGML_NATIVE=OFF, AVX-512 on, GGML_AMX_*=OFF)"}
    assert cpu_peers.llama_builds(res) == ("`build` (GGML_NATIVE=ON) for bf16; `build-noamx` (GGML_NATIVE="
                                           "OFF, AVX-512 on, GGML_AMX_*=OFF) for Q8_0 (they crash in its AMX "
                                           "path on this CPU)")
