"""Building ``ForwardBatch``es by hand for tests that drive ``Qwen3Model.forward`` directly."""

from __future__ import annotations

import torch

from fusedserve.kernels.forward_batch import ForwardBatch


def _slot(table: list[int], p: int, bs: int) -> int:
    return table[p // bs] * bs + p % bs


def prompt_batch(prompts: list[list[int]], tables: list[list[int]], bs: int,
                 cached: list[int] | None = None) -> ForwardBatch:
    """Prompt rows: row i computes ``prompts[i][cached[i]:]`` after ``cached[i]`` tokens already
    in its pages (``tables[i]``)."""
    cached = cached or [0] * len(prompts)
    ids, pos, slots, lens, qlens = [], [], [], [], []
    for p, t, c in zip(prompts, tables, cached):
        ids += p[c:]
        pos += range(c, len(p))
        slots += [_slot(t, q, bs) for q in range(c, len(p))]
        lens.append(len(p))
        qlens.append(len(p) - c)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(prompts), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    rows = torch.arange(len(prompts))  # a hybrid's state slots: row i's is i, zeroed where it starts
    return ForwardBatch(torch.tensor(ids, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32),
                        torch.tensor(slots), qsl, torch.tensor(lens, dtype=torch.int32), bt, num_decode=0,
                        prompt_query_lens=qlens, prompt_seq_lens=lens, state_slots=rows,
                        state_resets=rows[torch.tensor(cached) == 0])


def decode_batch(seqs: list[tuple[int, int, list[int]]], bs: int) -> ForwardBatch:
    """Decode rows: (last token, its position, block table) each."""
    width = max(len(t) for _, _, t in seqs)
    bt = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, (_, _, t) in enumerate(seqs):
        bt[i, : len(t)] = torch.tensor(t)
    n = len(seqs)
    return ForwardBatch(torch.tensor([s[0] for s in seqs], dtype=torch.int32),
                        torch.tensor([s[1] for s in seqs], dtype=torch.int32),
                        torch.tensor([_slot(t, p, bs) for _, p, t in seqs]),
                        torch.arange(n + 1, dtype=torch.int32),
                        torch.tensor([s[1] + 1 for s in seqs], dtype=torch.int32), bt, num_decode=n,
                        state_slots=torch.arange(n))
