"""Train the embedded default model (never run by install, tests or CI).

    apt-get install python3.11-doc      # the corpus: Python 3.11's documentation sources
    python -m fusedserve.coordinator.model_files.train_default \
        --out coordinator/model_files/default_model --minutes 25

Corpus: the reStructuredText sources of the Python 3.11 documentation, as Debian's
``python3.11-doc`` installs them (``/usr/share/doc/python3.11/html/_sources``; PSF
License Version 2). Markup is stripped to prose and code. One document in a hundred
(chosen by seed) is held out for perplexity. A byte-level BPE tokenizer is trained on
the training documents, then a small Qwen3 (GQA, q/k norm, tied embeddings) with
transformers' own ``Qwen3ForCausalLM``, so the checkpoint is a Hugging Face one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import time
from pathlib import Path

import torch

from fusedserve.coordinator.model_files.default_model import SPECIAL_TOKENS, tokenizer_config

log = logging.getLogger(__name__)

CORPUS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
SEED = 0

_UNDERLINE = re.compile(r"([=*\-~^#+\"'])\1{2,}")  # title under/overlines
_ROLE = re.compile(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")  # :func:`name <target>` -> name
_MARKUP = [(re.compile(r"``([^`]*)``"), r"\1"), (re.compile(r"\*\*([^*]+)\*\*"), r"\1"),
           (re.compile(r"`([^`<]*?)\s*<[^>]*>`_+"), r"\1"), (re.compile(r"`([^`]*)`_*"), r"\1")]


def clean(text: str) -> str:
    """reST -> plain text: drop directives, option lines and title underlines; keep prose and code."""
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith(".. ") or (s.startswith(":") and s.endswith(":")) or _UNDERLINE.fullmatch(s):
            continue
        if re.match(r"\s*:\w[\w-]*:( |$)", line):  # directive options
            continue
        line = _ROLE.sub(r"\1", line)
        for pattern, repl in _MARKUP:
            line = pattern.sub(repl, line)
        out.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def corpus(root: Path = CORPUS_DIR) -> tuple[list[str], list[str]]:
    """(train, held-out) documents, split by seed."""
    files = sorted(root.rglob("*.txt"))
    if not files:
        raise SystemExit(f"no corpus under {root}: apt-get install python3.11-doc")
    docs = [d for d in (clean(f.read_text(errors="replace")) for f in files) if len(d) > 200]
    rng = random.Random(SEED)
    held = set(rng.sample(range(len(docs)), max(1, len(docs) // 100)))
    return [d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held]


def train_tokenizer(docs: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def token_stream(tok, docs: list[str]) -> torch.Tensor:
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def perplexity(model, ids: torch.Tensor, window: int = 256) -> float:
    """exp(mean next-token loss) of a causal LM over ``ids`` in windows of ``window`` tokens."""
    total, n = 0.0, 0
    with torch.no_grad():
        for start in range(0, ids.numel() - 1, window):
            chunk = ids[start: start + window + 1]
            if chunk.numel() < 2:
                break
            logits = model(chunk[:-1].unsqueeze(0)).logits[0].float()
            total += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
            n += chunk.numel() - 1
    return math.exp(total / n)


def main(argv: list[str] | None = None) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).parent / "default_model"))
    ap.add_argument("--minutes", type=float, default=25.0, help="training time budget")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    train_docs, held_docs = corpus()
    tok = train_tokenizer(train_docs, SHAPE["vocab_size"])
    train_ids, held_ids = token_stream(tok, train_docs), token_stream(tok, held_docs)
    log.info("corpus: %d train docs (%d tokens), %d held out (%d tokens)", len(train_docs), train_ids.numel(),
             len(held_docs), held_ids.numel())
    eos = tok.token_to_id("<|endoftext|>")
    cfg = Qwen3Config(**SHAPE, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, eos_token_id=eos, bos_token_id=None, torch_dtype="bfloat16")
    model = Qwen3ForCausalLM(cfg)
    log.info("model: %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(SEED)
    deadline, warmup, step, t0 = time.time() + args.minutes * 60, 100, 0, time.time()
    budget_steps = None
    while True:
        elapsed = time.time() - t0
        if step == 20:  # estimate how many steps fit the budget, for the schedule
            budget_steps = max(warmup + 1, int(step * args.minutes * 60 / elapsed))
        if time.time() > deadline:
            break
        total = budget_steps or 10**9
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, step / total)))
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * cosine)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([train_ids[s: s + args.seq + 1] for s in starts])
        loss = model(batch[:, :-1], labels=batch[:, :-1].clone()).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            log.info("step %d/%s loss %.3f lr %.2e (%.0f s)", step, budget_steps, loss.item(), lr, elapsed)
    model.eval()
    ppl = perplexity(model, held_ids[:65536])
    log.info("held-out perplexity (fp32 training weights): %.2f after %d steps", ppl, step)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(2048), indent=2))
    (out / "heldout.txt").write_text("\n\n".join(held_docs) + "\n")
    (out / "training.json").write_text(json.dumps({
        "corpus": "Python 3.11 documentation sources (Debian python3.11-doc), PSF License Version 2",
        "seed": SEED, "steps": step, "batch": args.batch, "seq": args.seq, "lr": args.lr,
        "train_tokens": train_ids.numel(), "held_out_tokens": held_ids.numel(),
        "held_out_perplexity_fp32_train": ppl, "shape": SHAPE}, indent=2))


if __name__ == "__main__":
    main()
