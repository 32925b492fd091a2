"""The CPU peers on a host whose best native build is AVX2 (no AVX-512, no AVX-VNNI); long-context decode.

The report's "held to AVX2" section caps an AVX-512 host's engines at AVX2; this one runs every
engine natively on an AVX2-only CPU, where the memory system, the caches and the peers' own
choices are that CPU's. It also measures the batch-1 decode step at long contexts against the
read bandwidth (weights + K/V a step must read), bf16 and int8 caches: issue 59's long-context
target, on this host.

``python -m fusedserve.benchmarks.avx2_host --openvino-python PY --llama-cpp DIR --llama-python PY
[--json F]`` (the report's ``--only avx2_host`` runs it on such a host and stores
``benchmarks/results/cpu_peers_avx2_host.json``; elsewhere it draws that stored run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fusedserve.benchmarks import cpu_peers, decode_step
from fusedserve.benchmarks.common import fmt, isa_line
from fusedserve.coordinator.model_files.default_model import default_model_dir

ENGINES = [e for members in cpu_peers.CLASSES.values() for e in members]  # each weight class, its peers
CONTEXTS = (4096, 16384)
LONG_TARGETS = {4096: 0.8, 16384: 0.7}  # issue 59: share of the read bandwidth at batch 1


def long_context(contexts: tuple[int, ...] = CONTEXTS, steps: int = 8) -> list[dict]:
    """Batch-1 decode steps at each context, bf16 weights over a bf16 and an int8 KV cache."""
    model = str(default_model_dir(cpu_peers.PRESET))
    rows = []
    for kv in ("auto", "int8"):
        for c in contexts:
            res = decode_step.run([1], context=c, steps=steps, dtype="bfloat16", model_dir=model,
                                  kv_cache_dtype=kv)
            r = res["rows"][0]
            rows.append({"context": c, "kv_cache_dtype": kv, "step_ms": r["step_ms_spread"],
                         "bytes_read": r["bytes_read"], "weights_bytes": res["weights_bytes"],
                         "achieved_gbps": r["achieved_gbps"], "read_bw_gbps": res["read_bw_gbps"],
                         "fraction_of_read_bw": r["fraction_of_read_bw"], "kernels": res["kernels"]})
    return rows


def run(openvino_python: str | None, llama_cpp: str | None, llama_python: str | None,
        threads: int = 2) -> dict:
    peers = cpu_peers.measure(ENGINES, [1, 16, 64], 32, 64, threads, openvino_python, llama_cpp, llama_python)
    return {"peers": peers, "isa_line": isa_line(), "long_context": long_context()}


def _kv(row: dict) -> str:
    return "bf16" if row["kv_cache_dtype"] == "auto" else "int8"


def long_table(rows: list[dict]) -> list[str]:
    lines = ["| KV cache | context | ms/step | bytes read (weights + K/V) | GB/s | % of read bw | target |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {_kv(r)} | {r['context']} | {fmt(r['step_ms'])} | {r['bytes_read'] / 1e6:.0f} MB "
                     f"| {r['achieved_gbps']:.1f} | {100 * r['fraction_of_read_bw']:.0f}% "
                     f"| {100 * LONG_TARGETS.get(r['context'], 0):.0f}% |")
    return lines


def targets(res: dict, prefix: str) -> list[tuple[str, bool, str]]:
    """The long-context rows as report targets (the weight classes' come from the report)."""
    out = []
    for r in res["long_context"]:
        want = LONG_TARGETS.get(r["context"])
        if want is None:
            continue
        got = r["fraction_of_read_bw"]
        out.append((f"{prefix}batch-1 decode at context {r['context']} >= {100 * want:.0f}% of read "
                    f"bandwidth ({_kv(r)} KV cache)", got >= want, f"{100 * got:.0f}%"))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--openvino-python", default=None)
    ap.add_argument("--llama-cpp", default=None)
    ap.add_argument("--llama-python", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = run(args.openvino_python, args.llama_cpp, args.llama_python, args.threads)
    print(f"{res['peers']['machine']}; {res['isa_line']}")
    print("\n".join(cpu_peers.table(res["peers"])))
    print("\n".join(long_table(res["long_context"])))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
