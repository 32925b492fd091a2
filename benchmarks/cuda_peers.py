"""fusedserve on a CUDA GPU against transformers on the same GPU, side by side in one run.

The model is Qwen3-0.6B's real configuration with random weights (``default:qwen3-0.6b``),
bf16. Both engines get the same random prompts as token ids (32 in, 64 out, greedy, EOS
ignored) at batch 1/16/64: fusedserve's ``LLMEngine`` (captured decode graphs, async
scheduling, device sampling) and transformers' static-batch ``generate``. Then the decode
step alone (the launch path with its copies and counters), graphs against eager, against
the GPU's measured read bandwidth, with its h2d/d2h bytes per step. Where a step spends its time,
per kernel path and model, is ``fusedserve.benchmarks.cuda_profile``.

Needs a CUDA GPU; writes ``--json`` for ``fusedserve.benchmarks.report`` to fold into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from pathlib import Path

import torch

from fusedserve.benchmarks import decode_step
from fusedserve.benchmarks.common import fmt, machine, spread
from fusedserve.benchmarks.cpu_peers import PRESET, fusedserve_generate, prompts
from fusedserve.benchmarks.throughput import transformers_generate
from fusedserve.coordinator.model_files.default_model import default_model_dir


def medians(row: dict) -> dict[int, float]:
    """Per batch, the median tok/s (a stored run from before spreads holds plain numbers)."""
    return {int(b): v["median"] if isinstance(v, dict) else v for b, v in row.items()}


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _save(res: dict, path: str | None) -> None:
    """Written as each case ends: a run cut short by its time limit keeps what it measured."""
    if path:
        Path(path).write_text(json.dumps(res, indent=2))


def measure(batches: list[int], input_len: int, new: int, json_path: str | None = None, device: str = "cuda",
            model_dir: Path | None = None) -> dict:
    """Every figure, on ``device`` (the CPU only to check that the code runs:
    tests/kernels/test_decode_step.py)."""
    label = str(model_dir) if model_dir else f"default:{PRESET}"
    model_dir = model_dir or default_model_dir(PRESET)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    gpu = torch.cuda.get_device_name() if device == "cuda" else device
    res: dict = {"machine": machine(), "gpu": gpu, "date": time.strftime("%Y-%m-%d"), "model": label,
                 "input_len": input_len, "new_tokens": new, "results": {}, "errors": {}}
    engines = {"fusedserve-bf16": lambda b: fusedserve_generate(model_dir, b, new, None, device),
               "transformers-bf16": lambda b: transformers_generate(b, new, "bfloat16", 1, model_dir, device)}
    for name, run in engines.items():
        res["results"][name] = {}
        for b in batches:
            try:
                res["results"][name][b] = spread(run(prompts(b, input_len, vocab, seed=b)))
                print(f"  {name:>18} batch {b:>3}: {fmt(res['results'][name][b])} tok/s", flush=True)
            except Exception:  # noqa: BLE001 - one engine's failure is a figure, not the end of the run
                res["errors"][f"{name} batch {b}"] = traceback.format_exc()[-3000:]
                print(f"  {name} batch {b} failed:\n{res['errors'][f'{name} batch {b}']}", flush=True)
            _free()
            _save(res, json_path)
    res["steps"] = {}
    for graphs in ("auto", "off"):
        try:
            res["steps"][graphs] = decode_step.run(batches, context=128, steps=20, dtype="bfloat16",
                                                   model_dir=str(model_dir), device=device, graphs=graphs)
        except Exception:  # noqa: BLE001
            res["errors"][f"decode step graphs={graphs}"] = traceback.format_exc()[-3000:]
            print(res["errors"][f"decode step graphs={graphs}"], flush=True)
        _free()
        _save(res, json_path)
    return res


def table(res: dict) -> list[str]:
    """Markdown: output tok/s (median (min-max)) and the ratio of medians per batch; the decode step
    with and without graphs."""
    r = {name: {int(b): v for b, v in row.items()} for name, row in res["results"].items()}
    batches = sorted({b for v in r.values() for b in v})
    lines = ["| engine | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---" * (len(batches) + 1) + "|"]
    for name, row in r.items():
        lines.append(f"| {name} | " + " | ".join(fmt(row[b]) if b in row else "-" for b in batches) + " |")
    fs, hf = medians(r.get("fusedserve-bf16", {})), medians(r.get("transformers-bf16", {}))
    if fs and hf:
        lines.append("| fusedserve / transformers | " + " | ".join(
            f"{fs[b] / hf[b]:.2f}x" if b in fs and b in hf else "-" for b in batches) + " |")
    for graphs, step in res.get("steps", {}).items():
        spread_rows = "step_ms_spread" in step["rows"][0]
        spreads = "; ms/step: median (min-max) over the measured steps" if spread_rows else ""
        lines += ["", f"Decode step alone, graphs `{graphs}` (context {step['context']}; read bandwidth "
                      f"{step['read_bw_gbps']:.0f} GB/s, copy {step['copy_bw_gbps']:.0f} GB/s{spreads}):", "",
                  "| batch | ms/step | tok/s | % of read bw | h2d B/step | d2h B/step "
                  "| anchor's logits d2h |",
                  "|---|---|---|---|---|---|---|"]
        for row in step["rows"]:
            ms = fmt(row["step_ms_spread"], ".3f") if "step_ms_spread" in row else f"{row['step_ms']:.3f}"
            lines.append(f"| {row['batch']} | {ms} | {row['tokens_per_s']:.0f} | "
                         f"{100 * row['fraction_of_read_bw']:.0f}% | {row['h2d_bytes']} | "
                         f"{row['d2h_bytes']} | {row['anchor_logits_d2h']} |")
    if res.get("profile"):  # a stored run from before benchmarks.cuda_profile had its own JSON
        step = res.get("steps", {}).get("auto")
        ms = step["weights_bytes"] / step["read_bw_gbps"] / 1e6 if step else 0.0
        floor = f" Reading the weights once takes {ms:.2f} ms at the measured read bandwidth." if step else ""
        lines += ["", "Where a graphed decode launch spends its time (`benchmarks/cuda_profile.py`): the "
                      "replay's GPU time (CUDA events) against the whole launch path (wall), and the kernels "
                      f"one replay runs.{floor}", "",
                  "| batch | graph replay ms | launch path ms | kernels per replay |", "|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['replay_ms']:.3f} | {r['launch_ms']:.3f} "
                  f"| {r['kernels_per_replay']} |" for r in res["profile"]]
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fusedserve.benchmarks.cuda_peers needs a CUDA GPU")
    res = measure([int(b) for b in args.batches.split(",")], args.input_len, args.new_tokens, args.json)
    print(f"{res['machine']}; {res['gpu']}")
    print("\n".join(table(res)))
    _save(res, args.json)
    return res


if __name__ == "__main__":
    main()
