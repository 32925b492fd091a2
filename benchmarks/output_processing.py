"""The coordinator loop's host time per step with many streams at the stop-string maximum.

Model-free: the real engine core, scheduler, batch I/O, arena banks and output processor around
``tests.support.EchoRunner`` (a runner that reads and writes the same slots as a model runner and
samples its input token + 1), so the figure is the coordinator's own work per step: schedule,
write the bank, read the ids, detokenize, match stop strings, stream deltas. Each stream carries
``MAX_STOP_STRINGS`` stop strings of ``MAX_STOP_CHARS`` characters that never match, and the
same streams with no stop strings are the reference. Each figure is the median (min-max) of
``--runs`` runs.

    python -m fusedserve.benchmarks.output_processing --streams 64 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import time

from fusedserve.benchmarks.common import RUNS, fmt, machine, spread
from fusedserve.coordinator.engine.detokenizer import Detokenizer
from fusedserve.coordinator.engine.engine_core import EngineCore
from fusedserve.coordinator.engine.executor import InProcessExecutor
from fusedserve.coordinator.engine.output_processor import OutputProcessor
from fusedserve.coordinator.engine.sequence import Sequence
from fusedserve.coordinator.model_files.default_model import resolve_model
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.engine_config import EngineConfig
from fusedserve.shared_memory.slots import step_table
from tests.support import EchoRunner

VOCAB = 4096  # the default model's


def once(tok: TextTokenizer, streams: int, tokens: int, stops: list[str]) -> float:
    """Seconds of host time per step over the decode of ``streams`` requests."""
    vocab = VOCAB
    blocks = streams * (-(-(tokens + 16) // 16)) + 4
    cfg = EngineConfig.build(max_batch=streams, block_size=16, num_blocks=blocks, max_model_len=tokens + 32)
    arenas = [HostArena.create(step_table(), cfg.max_dims(vocab), tag="outbench") for _ in range(cfg.banks)]
    try:
        core = EngineCore.for_worker(cfg, vocab, OutputProcessor((), cfg.max_model_len), arenas,
                                     InProcessExecutor(EchoRunner(arenas, vocab)))
        for i in range(streams):
            p = SamplingParams(max_tokens=tokens, ignore_eos=True, stop=stops)
            seq = Sequence(f"s{i}", [300 + 7 * i], p, arrival=i, detok=Detokenizer(tok, stops))
            core.scheduler.enqueue(seq)
        core.step()  # the prefill launch
        t0, steps = time.perf_counter(), 0
        while core.has_work():
            core.step()
            steps += 1
        return (time.perf_counter() - t0) / steps
    finally:
        for a in arenas:
            a.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=RUNS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tok = TextTokenizer.from_dir(resolve_model("default"))
    most = [f"{i:03d}" + "\x07" * (MAX_STOP_CHARS - 3) for i in range(MAX_STOP_STRINGS)]
    res = {"machine": machine(), "streams": args.streams, "tokens": args.tokens}
    print(f"{machine()}; {args.streams} streams x {args.tokens} tokens, model-free (EchoRunner)")
    for name, stops in (("no_stop_strings", []), ("max_stop_strings", most)):
        s = spread([once(tok, args.streams, args.tokens, stops) * 1e3 for _ in range(args.runs)])
        res[name + "_ms_per_step"] = s
        print(f"  {name.replace('_', ' ')}: {fmt(s, '.2f')} ms per step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
