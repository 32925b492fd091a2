"""The tensor-parallel decode step on the CPU: TP=2 (two processes of T/2 threads, gloo) against
TP=1 (one process of T threads), at equal total threads.

    python -m fusedserve.benchmarks.tp_decode [--model benchmark] [--batches 1,16] [--threads 2]

Each rank runs the real launch path (``decode_step.run``: arena, its share of the forward with
the all-reduces and the logits gather, the sampler, rank 0's counted copy-back), greedy, context
128; the step is rank 0's. Target: TP=2 costs at most 15% over TP=1. TP=2 adds per layer two
all-reduces of [B, hidden] and per step the embedding's all-reduce and the logits' gather, each a
gloo round trip; its d2h stays B x 4 bytes (ids only), TP=1's figure. Each figure is the median
(min-max) over ``--runs`` runs of a run's median step. A run measures TP=1 and TP=2 back to back,
in alternating order (this host's speed drifts by a third over minutes); the ratio is the median
of the runs' TP=2 / TP=1 ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.multiprocessing as mp

from fusedserve.benchmarks import decode_step
from fusedserve.benchmarks.common import fmt, machine, spread
from fusedserve.coordinator.model_files.default_model import default_model_dir
from fusedserve.coordinator.server.ray_cluster import free_port
from fusedserve.kernels.native import build as native
from fusedserve.worker.model.tensor_parallel import TensorParallel
from fusedserve.worker.tensor_group import GroupRank, TensorGroup


def _rank(rank: int, size: int, port: int, threads: int, args: dict, result) -> None:
    import torch.distributed as dist
    import zmq

    torch.set_num_threads(threads)
    tp = TensorParallel(rank, size)
    if size > 1:  # the served group's set-up: shared-memory collectives where the native build runs
        group = TensorGroup(GroupRank(rank, size), f"127.0.0.1:{port}", torch.device("cpu"), zmq.Context())
        tp = group.tp if args["comm"] == "shm" else tp
    try:
        res = decode_step.run(args["batches"], 128, args["steps"], args["dtype"], model_dir=args["model_dir"],
                              tp=tp)
        if rank == 0:
            result.put(res)
    finally:
        if size > 1:
            dist.destroy_process_group()


def run_group(size: int, total_threads: int, args: dict) -> dict:
    """One run of ``size`` ranks sharing ``total_threads``: rank 0's ``decode_step.run`` result."""
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, size, port, total_threads // size, args, result))
             for r in range(size)]
    for p in procs:
        p.start()
    res = result.get(timeout=1800)
    for p in procs:
        p.join()
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmark", help="a preset of the default model, or a checkpoint dir")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2, help="total threads, split over the ranks")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--comm", default="shm", choices=["shm", "gloo"],
                    help="TP=2's collectives: the shared-memory file (served groups' default) or gloo")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    path = Path(args.model) if Path(args.model).is_dir() else default_model_dir(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    job = {"batches": batches, "steps": args.steps, "dtype": args.dtype, "model_dir": str(path),
           "comm": args.comm}
    native.require()  # built once here, not raced by the ranks
    steps: dict[int, dict[int, list[float]]] = {size: {b: [] for b in batches} for size in (1, 2)}
    d2h: dict[int, dict[int, int]] = {1: {}, 2: {}}
    kernels = {}
    for i in range(args.runs):
        for size in ((1, 2) if i % 2 == 0 else (2, 1)):
            res = run_group(size, args.threads, job)
            kernels[size] = res["kernels"]
            for row in res["rows"]:
                steps[size][row["batch"]].append(row["step_ms"])
                d2h[size][row["batch"]] = row["d2h_bytes"]
    isa = native.kernels().isa() if native.kernels() is not None else "aten"
    print(f"{machine()}; ISA {isa}; model {args.model}, {args.dtype}, context 128, greedy, "
          f"{args.threads} threads in all, TP=2 over {args.comm}; step ms, median (min-max) of "
          f"{args.runs} runs")
    print(f"{'batch':>5s} {'TP=1':>22s} {'TP=2':>22s} {'TP2 / TP1':>10s} {'d2h TP1/TP2':>12s}")
    res: dict = {"machine": machine(), "isa": isa, "model": args.model, "dtype": args.dtype,
                 "comm": args.comm, "threads": args.threads, "runs": args.runs, "kernels": kernels,
                 "step_ms": {}, "ratios": {}, "d2h_bytes": d2h}
    for b in batches:
        one, two = spread(steps[1][b]), spread(steps[2][b])
        res["step_ms"][b] = {"tp1": one, "tp2": two}
        res["ratios"][b] = statistics.median([y / x for x, y in zip(steps[1][b], steps[2][b])])
        print(f"{b:5d} {fmt(one, '.2f'):>22s} {fmt(two, '.2f'):>22s} {res['ratios'][b]:10.2f} "
              f"{d2h[1][b]:>5d}/{d2h[2][b]:<6d}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
