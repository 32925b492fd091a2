"""What structured outputs cost a decode: batch 16, every row under a JSON schema, against the
same prompts unconstrained, through the offline engine (the same scheduler, arena and
device-side mask as the server).

    python -m fusedserve.benchmarks.structured_decode [--models default,qwen3-0.6b]

Target: the constrained batch keeps >= 90% of the unconstrained decode throughput.
``benchmark`` is the random-weight preset between them (12 layers, hidden 1024, 32k vocabulary). The
schema asks for at least 64 items, so every row runs to ``--tokens`` either way (the same
work). Rows are sampled (temperature 0.8, seeded). Models: ``default`` (4,096 tokens) and
``qwen3-0.6b``, Qwen3-0.6B's shape with random weights and a Qwen3-sized tokenizer
(``grammar_libs.wide_tokenizer``), so the mask covers 151,936 tokens a row. Each figure is
the median (min-max) of ``--runs`` runs, constrained and free alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from fusedserve.benchmarks.common import fmt, machine, median, spread
from fusedserve.benchmarks.grammar_libs import wide_tokenizer
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import cache_root, default_model_dir
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.coordinator.structured.structured_spec import StructuredSpec

SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "word"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "word": {"type": "string", "maxLength": 10}}}}
PROMPTS = [f"Record {i}: the list of items in the inventory is" for i in range(64)]


def model_dir(name: str) -> Path:
    if name in ("default", "benchmark"):  # the trained default; the random 12-layer preset
        return Path("default" if name == "default" else "default:benchmark")
    if name != "qwen3-0.6b":
        return Path(name)
    out = cache_root() / "bench-qwen3-0.6b-wide-tokenizer"
    if not (out / "config.json").is_file():
        src = default_model_dir("qwen3-0.6b")
        out.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "model.safetensors", "tokenizer_config.json"):
            if not (out / f).exists():
                os.symlink(src / f, out / f)
        (out / "tokenizer.json").write_text(wide_tokenizer().read_text())
    return out


def run(name: str, batch: int, tokens: int, runs: int, dtype: str) -> dict:
    rc = dict(max_batch=batch, num_blocks=batch * (tokens + 64) // 16 + 8)
    with LLMEngine(str(model_dir(name)), dtype=dtype, **rc) as eng:
        prompts = PROMPTS[:batch]

        def once(constrained: bool) -> float:
            spec = StructuredSpec("json", SCHEMA) if constrained else None
            params = [SamplingParams(max_tokens=tokens, temperature=0.8, seed=i, ignore_eos=True,
                                     structured=spec) for i in range(batch)]
            eng.core.scheduler.blocks.flush()
            t0 = time.perf_counter()
            outs = eng.generate(prompts, params)
            dt = time.perf_counter() - t0
            assert all(len(o.token_ids) == tokens for o in outs), [len(o.token_ids) for o in outs]
            if constrained:
                assert outs[0].text.startswith("[{\"id\": ")
            return batch * tokens / dt

        once(True), once(False)  # warm-up: kernels, the grammar's caches
        free, held = [], []
        for _ in range(runs):
            held.append(once(True))
            free.append(once(False))
    return {"free_tok_s": spread(free), "constrained_tok_s": spread(held),
            "ratio": median(spread(held)) / median(spread(free)), "vocab": eng.model.config.vocab_size}


def parser_cost(runs: int) -> dict:
    """The gateway's reasoning split and tool-call parsing, per streamed token: a Qwen3 turn
    (a think block, prose, two calls) pushed through ``ChatStream`` one token's text at a time,
    against the same text passed through as plain content."""
    from fusedserve.coordinator.model_files.default_model import resolve_model
    from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
    from fusedserve.coordinator.openai.chat_output import ChatStream
    from fusedserve.coordinator.openai.tool_choice import ToolPlan

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s", "unit": "C"}}\n</tool_call>'
    turn = ("<think>\nThe user wants the weather in two cities, so I call the tool twice and compare "
            "the results before I answer.\n</think>\n\nLet me check both cities.\n" + call % "Paris" + "\n"
            + call % "Rome")
    tok = TextTokenizer.from_dir(resolve_model("default"))
    pieces = [tok.decode([t]) for t in tok.encode(turn)]
    tools = ToolPlan("auto", [{"type": "function", "function": {"name": "get_weather"}}])

    def per_token(parse: bool) -> float:
        t0 = time.perf_counter()
        for _ in range(20):
            stream = ChatStream(parse, False, tools if parse else ToolPlan("none"))
            for p in pieces:
                stream.push(p)
            stream.finish("stop")
        return (time.perf_counter() - t0) / (20 * len(pieces)) * 1e6

    return {"tokens": len(pieces), "parsed_us": spread([per_token(True) for _ in range(runs)]),
            "plain_us": spread([per_token(False) for _ in range(runs)])}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="default,qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    print(f"{machine()}; batch {args.batch}, {args.tokens} tokens a row, {args.dtype}, async scheduling")
    print(f"{'model':12s} {'vocab':>7s} {'free tok/s':>22s} {'constrained tok/s':>22s} {'ratio':>6s}")
    res: dict = {"machine": machine(), "batch": args.batch, "tokens": args.tokens}
    for name in args.models.split(","):
        r = run(name, args.batch, args.tokens, args.runs, args.dtype)
        res[name] = r
        print(f"{name:12s} {r['vocab']:7d} {fmt(r['free_tok_s']):>22s} {fmt(r['constrained_tok_s']):>22s} "
              f"{r['ratio']:6.2f}")
    res["parsers"] = p = parser_cost(args.runs)
    print(f"gateway per streamed token: reasoning + tool-call parsing {fmt(p['parsed_us'], '.2f')} us, "
          f"plain content {fmt(p['plain_us'], '.2f')} us ({p['tokens']}-token Qwen3 turn)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
