"""Where one long prompt's prefill spends its time: the GEMMs, attention, the fused per-row and
per-head ops, and the rest.

fusedserve's offline engine (``LLMEngine``, in this process, as ``cpu_peers --prefill`` runs it)
prefills one prompt of ``--tokens`` random ids to its first token, Qwen3-0.6B's shape
(``default:qwen3-0.6b``), bf16, with the engine's own chunking. Each kernel call is timed on the
wall clock around it: the CPU kernels run synchronously, so a call's time is its kernel's.

- GEMMs: every linear (the projections, and lm_head for the last token);
- attention: the attention backend's ``attend`` (prompt attention over the pages);
- fused ops: add + RMS norm, q/k norm + rotary + cache write, SiLU x up;
- rest: the prefill's wall time less those (embedding, rotary gathers, sampling, scheduling).

Rates: a GEMM does 2 * rows * K * N flops; causal attention 4 * heads * head_dim per (query, key)
pair with the key at or before the query (QK^T and PV), L (L + 1) / 2 pairs a layer for L tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fusedserve.benchmarks.common import RUNS, fmt, machine, spread
from fusedserve.benchmarks.cpu_peers import PRESET, prompts
from fusedserve.coordinator.model_files.default_model import default_model_dir

PARTS = ("GEMMs", "attention", "fused ops", "rest")


@dataclass
class PartClock:
    """Seconds and flops per part, summed over the timed calls of the methods ``wrap`` replaced."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    flops: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))

    def reset(self) -> None:
        for part in PARTS:
            self.seconds[part], self.flops[part], self.calls[part] = 0.0, 0.0, 0

    @contextmanager
    def wrap(self, cls: type, name: str, part: str,
             flops: Callable[..., float] | None = None) -> Iterator[None]:
        """Time every call of ``cls.name`` into ``part`` while the block runs (the class's own
        method comes back after it)."""
        original = getattr(cls, name)

        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0
                self.calls[part] += 1
                if flops is not None:
                    self.flops[part] += flops(*args, **kwargs)

        setattr(cls, name, timed)
        try:
            yield
        finally:
            setattr(cls, name, original)


def gemm_flops(_op: object, x: torch.Tensor, _w: object, out: torch.Tensor, *args: object,
               **kwargs: object) -> float:
    return 2.0 * x.shape[0] * x.shape[1] * out.shape[-1]


def measure(tokens: int, runs: int = RUNS, preset: str = PRESET) -> dict:
    """``runs`` prefills of one ``tokens``-token prompt on the ``preset`` embedded model, each split
    into ``PARTS``."""
    from fusedserve.coordinator.engine.llm_engine import LLMEngine
    from fusedserve.coordinator.sampling_params import SamplingParams

    model_dir = default_model_dir(preset)
    config = json.loads((model_dir / "config.json").read_text())
    prompt = prompts(1, tokens, config["vocab_size"], seed=0)
    blocks = -(-(tokens + 2) // 16) + 4
    clock = PartClock()
    per_run: list[dict[str, float]] = []
    with LLMEngine(str(model_dir), dtype="bfloat16", max_batch=1, block_size=16, num_blocks=blocks,
                   max_model_len=tokens + 18, sampler_candidates=8) as eng:
        eng.generate([prompt[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        kernels = eng.model.kernels
        ops = type(kernels.ops)
        with (clock.wrap(type(kernels.linear), "__call__", "GEMMs", gemm_flops),
              clock.wrap(type(eng.runner.ws.attention), "attend", "attention"),
              clock.wrap(ops, "add_rms_norm", "fused ops"), clock.wrap(ops, "qk_norm_rope", "fused ops"),
              clock.wrap(ops, "silu_mul", "fused ops")):
            for _ in range(runs):
                eng.core.scheduler.blocks.flush()  # every run prefills the whole prompt
                clock.reset()
                t0 = time.perf_counter()
                eng.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
                total = time.perf_counter() - t0
                run = {p: clock.seconds[p] for p in PARTS[:-1]}
                run["rest"] = total - sum(run.values())
                run["total"] = total
                per_run.append(run)
                gemm_flop = clock.flops["GEMMs"]
                calls = dict(clock.calls)
        info = eng.model.kernel_info()
    heads, head_dim, layers = config["num_attention_heads"], config["head_dim"], config["num_hidden_layers"]
    attention_flop = 4.0 * heads * head_dim * layers * tokens * (tokens + 1) / 2
    seconds = {p: spread([r[p] for r in per_run]) for p in (*PARTS, "total")}
    flop = {"GEMMs": gemm_flop, "attention": attention_flop}
    return {"machine": machine(), "model": f"default:{preset}", "tokens": tokens,
            "threads": torch.get_num_threads(), "kernels": info, "seconds": seconds, "calls": calls,
            "flop": flop,
            "gflops": {p: f / statistics.median(r[p] for r in per_run) / 1e9 for p, f in flop.items()}}


def table(res: dict) -> list[str]:
    total = res["seconds"]["total"]["median"]
    lines = [f"| part of the {res['tokens']}-token prefill | s | share | GFLOP | GFLOP/s |",
             "|---|---|---|---|---|"]
    for part in PARTS:
        s = res["seconds"][part]
        flop, rate = res["flop"].get(part), res["gflops"].get(part)
        flop_s = "-" if flop is None else f"{flop / 1e9:,.0f}"
        rate_s = "-" if rate is None else f"{rate:.0f}"
        lines.append(f"| {part} | {fmt(s, '.2f')} | {100 * s['median'] / total:.0f}% | {flop_s} | {rate_s} |")
    lines.append(f"| total | {fmt(res['seconds']['total'], '.2f')} | 100% | | |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument("--threads", type=int, default=None, help="torch's threads (default: its own choice)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = measure(args.tokens, args.runs)
    print(f"{res['machine']}; kernels: {res['kernels']}")
    print("\n".join(table(res)))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
