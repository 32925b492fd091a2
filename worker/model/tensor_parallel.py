"""One rank's share of a Qwen3 model split across a tensor-parallel group, and its collectives.

The split is Megatron's, as vLLM and SGLang do it:
- q/k/v and gate/up are column-parallel: each rank holds its attention heads and its slice of
  the MLP's intermediate dimension, so attention and SiLU run on local data alone;
- o_proj and down are row-parallel: each rank's output is a partial sum, completed by one
  all-reduce each;
- KV heads are split with their query heads, and replicated when the group outnumbers them (a
  rank then holds the one KV head its query heads read);
- the embedding and the lm_head are vocab-parallel: each rank holds ``ceil(V / N)`` rows. The
  embedding zeroes the tokens it does not hold and all-reduces; the lm_head's logits are
  all-gathered, so every rank has the full row.

Sampling: every rank samples the gathered logits with the same deterministic sampler (a draw is
a function of the logits and (seed, step) alone), so every rank holds the same ids without a
further collective, and each rank feeds the next launch from its own copy. Only rank 0 copies
them to the host. A Qwen3-MoE layer's experts are split like the MLP (each expert's intermediate
dimension), or, with expert parallelism, placed whole: rank r holds experts
``[r E/N, (r+1) E/N)``; either way the layer ends in one all-reduce.

A ``TensorParallel`` of size 1 (``SINGLE``) is the whole model: every collective is the identity.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from fusedserve.kernels.model_description.config import ConfigError, Qwen3Config


class GroupBroken(RuntimeError):
    """A collective failed: a rank of the group is gone, and the group can compute nothing more."""


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    # How the ranks exchange tensors: an object with ``all_reduce(t)`` and ``all_gather(out, t)``
    # (``kernels/native/shm_comm.py``: CPU ranks on one host), or None: torch.distributed's default group.
    comm: Any = None

    # ----------------------------------------------------------------- the split

    def check(self, c: Qwen3Config) -> None:
        """Refuse a model this group cannot split evenly, naming the dimension."""
        n = self.size
        if n == 1:
            return
        if c.num_attention_heads % n:
            raise ConfigError(f"tensor parallel size {n} does not divide num_attention_heads "
                              f"({c.num_attention_heads})")
        if c.num_key_value_heads % n and n % c.num_key_value_heads:
            raise ConfigError(f"tensor parallel size {n} and num_key_value_heads ({c.num_key_value_heads}): "
                              "one must divide the other")
        if c.intermediate_size % n:
            raise ConfigError(f"tensor parallel size {n} does not divide intermediate_size "
                              f"({c.intermediate_size})")
        la = c.linear_attention
        if la is not None and (la.num_key_heads % n or la.num_value_heads % n):
            raise ConfigError(f"tensor parallel size {n} does not divide linear_num_key_heads "
                              f"({la.num_key_heads}) and linear_num_value_heads ({la.num_value_heads})")
        if c.shared_expert_intermediate_size % n:
            raise ConfigError(f"tensor parallel size {n} does not divide shared_expert_intermediate_size "
                              f"({c.shared_expert_intermediate_size})")
        if c.num_experts:
            if self.expert_parallel and c.num_experts % n:
                raise ConfigError(f"expert parallel size {n} does not divide num_experts ({c.num_experts})")
            if not self.expert_parallel and c.moe_intermediate_size % n:
                raise ConfigError(f"tensor parallel size {n} does not divide moe_intermediate_size "
                                  f"({c.moe_intermediate_size})")

    def local_config(self, c: Qwen3Config) -> Qwen3Config:
        """The shapes this rank computes: its heads, its slice of the MLP (and of each expert
        unless experts are placed whole). ``vocab_size`` stays the model's: logits are whole."""
        if self.size == 1:
            return c
        self.check(c)
        n = self.size
        moe_inter = c.moe_intermediate_size if self.expert_parallel else c.moe_intermediate_size // n
        la = c.linear_attention
        if la is not None:  # a hybrid's linear-attention heads split like attention heads
            la = dataclasses.replace(la, num_key_heads=la.num_key_heads // n,
                                     num_value_heads=la.num_value_heads // n)
        return dataclasses.replace(c, num_attention_heads=c.num_attention_heads // n,
                                   num_key_value_heads=max(1, c.num_key_value_heads // n),
                                   intermediate_size=c.intermediate_size // n,
                                   moe_intermediate_size=moe_inter, linear_attention=la,
                                   shared_expert_intermediate_size=c.shared_expert_intermediate_size // n)

    def heads(self, c: Qwen3Config) -> range:
        """This rank's query heads."""
        per = c.num_attention_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, c: Qwen3Config) -> range:
        """The KV heads this rank's query heads read (one, replicated, when N > KV heads)."""
        if self.size <= c.num_key_value_heads:
            per = c.num_key_value_heads // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        group = c.num_attention_heads // c.num_key_value_heads
        first = self.heads(c).start // group
        return range(first, first + 1)

    def split(self, total: int) -> range:
        """This rank's even share of a dimension of ``total``."""
        per = total // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def vocab_rows(self, vocab: int) -> int:
        """Rows of the vocab-parallel embedding and lm_head per rank (the last one padded)."""
        return -(-vocab // self.size)

    def vocab(self, vocab: int) -> range:
        """The token ids this rank holds (the last rank's range may run short of its rows)."""
        per = self.vocab_rows(vocab)
        return range(min(vocab, self.rank * per), min(vocab, (self.rank + 1) * per))

    def owns_expert(self, expert: int, num_experts: int) -> bool:
        """Whether this rank holds ``expert`` (always, unless experts are placed whole)."""
        return not self.expert_parallel or expert // (num_experts // self.size) == self.rank

    # ----------------------------------------------------------------- collectives

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the group, in place (a row-parallel projection's partial outputs)."""
        if self.size > 1:
            self._collective(lambda comm: comm.all_reduce(t))

    def embed(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        """``out = embedding[ids]`` from a vocab-parallel ``table`` (this rank's rows)."""
        if self.size == 1:
            torch.index_select(table, 0, ids, out=out)
            return
        start = self.rank * self.vocab_rows(table.shape[0] * self.size)
        local = ids.to(torch.int64) - start
        outside = (local < 0) | (local >= table.shape[0])
        torch.index_select(table, 0, local.masked_fill_(outside, 0), out=out)
        out.masked_fill_(outside[:, None], 0)
        self.all_reduce(out)

    def gather_vocab(self, local: torch.Tensor, out: torch.Tensor, gathered: torch.Tensor | None) -> None:
        """``out`` [n, V] = every rank's ``local`` [n, V/N] logits side by side (``gathered``:
        [N, rows, V/N] scratch, rows >= n)."""
        if self.size == 1:
            out.copy_(local)
            return
        n, per = local.shape
        parts = list(gathered[:, :n].unbind(0))
        self._collective(lambda comm: comm.all_gather(parts, local.contiguous()))
        out.copy_(gathered[:, :n].permute(1, 0, 2).reshape(n, self.size * per)[:, : out.shape[1]])

    def _collective(self, op) -> None:
        import torch.distributed as dist

        try:
            op(self.comm or dist)
        except (RuntimeError, ValueError) as exc:  # a peer gone: closed its connection, timed out
            raise GroupBroken(f"tensor-parallel rank {self.rank}: collective failed: {exc}") from exc


SINGLE = TensorParallel()
