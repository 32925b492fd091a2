"""One worker's decode step vs batch size, against the memory-bandwidth limit.

Runs the real launch path (arena -> device copies, one forward, the sampler, counted
copy-back) in-process, greedy, and reports per-step time (median, min and max over the
measured steps), tokens/s, bytes read per step (weights + KV), the fraction of the measured
read bandwidth reached, and the h2d / d2h bytes next to the anchor's old per-step logits
copy (B x vocab x 4).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from fusedserve.benchmarks.common import checkpoint, copy_bandwidth, fmt, machine, read_bandwidth, spread
from fusedserve.coordinator.engine.batch_io import write_batch
from fusedserve.coordinator.engine.scheduled_batch import ScheduledBatch
from fusedserve.coordinator.engine.sequence import Sequence
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.linear import Int8Weight, PackedWeight
from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.engine_config import EngineConfig
from fusedserve.shared_memory.slots import step_table
from fusedserve.worker.model.qwen3 import Qwen3Model
from fusedserve.worker.model.tensor_parallel import SINGLE, TensorParallel
from fusedserve.worker.model_runner import ModelRunner


def weight_bytes(model: Qwen3Model) -> int:
    """Bytes a decode step reads from weights: every layer, final norm and lm_head (for a MoE
    model, every expert: what all of them hold, not what one token reads)."""
    w = model.w
    n = w.final_norm.nbytes + _nbytes(w.lm_head)
    for lw in w.layers:
        for t in vars(lw).values():
            if isinstance(t, list):
                n += sum(_nbytes(gu) + _nbytes(d) for gu, d in t)
            elif t is not None:
                n += _nbytes(t)
    return n


def _nbytes(w: torch.Tensor | Int8Weight | PackedWeight) -> int:
    return w.q.nbytes + w.scale.nbytes if isinstance(w, Int8Weight) else w.nbytes


def greedy_batch(tables: np.ndarray, pos: int, block_size: int) -> ScheduledBatch:
    """A synthetic greedy decode step: every row at position ``pos`` of its block table."""
    b = tables.shape[0]
    seqs = [Sequence(f"bench{i}", [7], SamplingParams(max_tokens=1 << 30, seed=0)) for i in range(b)]
    return ScheduledBatch(
        seqs=tuple(seqs), num_decode=b, query_lens=(1,) * b,
        token_ids=np.full(b, 7, dtype=np.int32), positions=np.full(b, pos, dtype=np.int32),
        slot_mapping=(tables[:, pos // block_size] * block_size + pos % block_size).astype(np.int64),
        seq_lens=np.full(b, pos + 1, dtype=np.int32), block_tables=tables,
        feed_rows=np.full(b, -1, dtype=np.int32), samples=(True,) * b, computed_to=(pos + 1,) * b,
        draw_steps=(0,) * b)


def bench_runner(model: Qwen3Model, tag: str,
                 **settings: object) -> tuple[EngineConfig, HostArena, ModelRunner]:
    """A model runner over one arena bank of its own, sized by ``settings`` (EngineConfig names)."""
    cfg = EngineConfig.build(max_model_len=model.max_model_len, **settings)
    arena = HostArena.create(step_table(), cfg.max_dims(model.config.vocab_size), tag=tag)
    return cfg, arena, ModelRunner(model, cfg, arena, writes_outputs=model.tp.rank == 0)


def launch(arena: HostArena, batch: ScheduledBatch, step: int, cfg: EngineConfig, vocab: int):
    """The descriptor of ``batch`` written into ``arena`` (bank 0)."""
    return write_batch(arena, batch, step, 0, cfg.device.sampler_candidates, vocab)[0]


def run(batches: list[int], context: int, steps: int, dtype: str, quantization: str | None = None,
        model_dir: str | None = None, device: str = "cpu", graphs: str = "off",
        tp: TensorParallel = SINGLE, kv_cache_dtype: str = "auto") -> dict:
    """``graphs``: the runner's setting ("auto" captures CUDA graphs per batch bucket). ``tp``: run
    one rank of a tensor-parallel group (every rank calls this at once; only rank 0 copies ids
    back, and no rank probes the bandwidth). ``kv_cache_dtype``: auto or int8."""
    model = Qwen3Model.from_pretrained(model_dir or checkpoint(), dtype, device,
                                       max_model_len=context + steps + 16, quantization=quantization, tp=tp)
    c = model.config
    bs = 16
    max_b = max(batches)
    per_seq = -(-(context + steps + 1) // bs)
    cfg, arena, runner = bench_runner(model, "bench", max_batch=max_b, block_size=bs,
                                      num_blocks=max_b * per_seq, sampler_candidates=64, graphs=graphs,
                                      kv_cache_dtype=kv_cache_dtype)
    wbytes = weight_bytes(model)
    kv_per_token = runner.kv.nbytes // runner.kv.data.shape[2] * tp.size  # every layer's K and V, a token
    rows = []
    for b in batches:
        tables = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)
        times, rec = [], None
        for s in range(steps):
            pos = context + s
            desc = launch(arena, greedy_batch(tables, pos, bs), s, cfg, c.vocab_size)
            t0 = time.perf_counter()
            rec = runner.execute(desc)
            times.append(time.perf_counter() - t0)
        step = spread([x * 1e3 for x in (times[2:] if len(times) > 4 else times)])
        step_s = step["median"] / 1e3
        read = wbytes + b * (context + steps // 2) * kv_per_token
        rows.append({"batch": b, "step_ms": step["median"], "step_ms_spread": step,
                     "tokens_per_s": b / step_s, "bytes_read": read, "h2d_bytes": rec.h2d,
                     "d2h_bytes": rec.d2h, "anchor_logits_d2h": b * c.vocab_size * 4})
    arena.close()
    kernels = model.kernel_info()
    del runner, model  # the bandwidth probe's buffers need the memory back (a GPU's too)
    if tp.size > 1:
        return {"machine": machine(), "dtype": dtype, "context": context, "weights_bytes": wbytes,
                "kernels": kernels, "rows": rows}
    bw_read, bw_copy = read_bandwidth(device=device), copy_bandwidth(device=device)
    for r in rows:
        r["achieved_gbps"] = r["bytes_read"] / (r["step_ms"] / 1e3) / 1e9
        r["fraction_of_read_bw"] = r["achieved_gbps"] * 1e9 / bw_read
    return {"machine": machine(), "device": device, "graphs": graphs, "dtype": dtype, "context": context,
            "weights_bytes": wbytes, "quantization": quantization or "none", "kernels": kernels,
            "kv_cache_dtype": kv_cache_dtype,
            "read_bw_gbps": bw_read / 1e9, "copy_bw_gbps": bw_copy / 1e9, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, choices=["int8", "int8-weight-only", "int4"])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the benchmark model)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = run([int(b) for b in args.batches.split(",")], args.context, args.steps, args.dtype,
              args.quantization, args.model, kv_cache_dtype=args.kv_cache_dtype)
    print(f"{res['machine']}; read bw {res['read_bw_gbps']:.1f} GB/s, copy bw {res['copy_bw_gbps']:.1f} GB/s")
    print(f"kernels: {res['kernels']}")
    print(f"weights read per step: {res['weights_bytes'] / 2**20:.0f} MiB ({res['dtype']}, "
          f"quantization {res['quantization']}); KV cache {res['kv_cache_dtype']}")
    head = ("B", "ms/step (min-max)", "tok/s", "GB/s", "%bw", "h2d", "d2h", "anchor d2h")
    print("{:>4} {:>22} {:>8} {:>6} {:>5} {:>6} {:>6} {:>11}".format(*head))
    for r in res["rows"]:
        print(f"{r['batch']:>4} {fmt(r['step_ms_spread'], '.2f'):>22} {r['tokens_per_s']:>8.1f} "
              f"{r['achieved_gbps']:>6.1f} "
              f"{100 * r['fraction_of_read_bw']:>4.0f}% {r['h2d_bytes']:>6} {r['d2h_bytes']:>6} "
              f"{r['anchor_logits_d2h']:>11}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
