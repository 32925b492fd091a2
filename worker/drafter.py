"""A draft model proposing tokens on the device, inside the launch (``speculative_method draft``).

A smaller Qwen3 sharing the target's vocabulary runs on the same worker with its own paged KV cache
over the same block ids and slots, so the coordinator's block tables, slot mapping and rollback serve
both. Before the target's forward:

1. one pass over every row but the proposal rows (prompt chunks, every decode row): the draft's K/V
   stay in step with every token the target computes, and each speculating request's newest token
   gives the draft's first proposal;
2. k - 1 decode steps over the speculating requests, each feeding the last proposal and proposing the
   next, and one more that writes the last proposal's K/V (used when every proposal is accepted).

Proposals are the draft's argmax (a point-mass draft q: ``kernels/speculation.py``'s rule keeps the
target's distribution) and are written into the proposal rows' token ids; they never leave the device.
Every op has a shape fixed by the launch, with no host read.
"""

from __future__ import annotations

import torch

from fusedserve.kernels.forward_batch import ForwardBatch
from fusedserve.kernels.speculation import request_rows
from fusedserve.shared_memory.contract import LaunchDescriptor
from fusedserve.shared_memory.engine_config import EngineConfig
from fusedserve.worker.model.qwen3 import Qwen3Model


class DraftError(ValueError):
    """The draft model cannot propose for this target."""


class Drafter:
    def __init__(self, draft: Qwen3Model, cfg: EngineConfig, vocab_size: int):
        if draft.config.vocab_size != vocab_size:
            raise DraftError(f"the draft model's vocabulary ({draft.config.vocab_size}) is not the target's "
                             f"({vocab_size}): its token ids would mean other tokens")
        max_batch, block_size = cfg.scheduler.max_batch, cfg.cache.block_size
        self.model = draft
        self.kv = draft.new_kv_cache(cfg.num_blocks + 1, block_size, cfg.cache.kv_cache_dtype)
        self.ws = draft.new_workspace(max_batch, block_size, cfg.cache.kv_cache_dtype)
        self.logits = torch.empty(max_batch, vocab_size, dtype=torch.float32, device=draft.device)

    @classmethod
    def load(cls, cfg: EngineConfig, target: Qwen3Model) -> Drafter | None:
        """The draft of a resolved ``cfg`` on the target's device, in its dtype; None without one."""
        path = cfg.speculative.speculative_model
        if cfg.speculative.speculative_method != "draft" or path is None:
            return None
        draft = Qwen3Model.from_pretrained(path, str(target.dtype).removeprefix("torch."), target.device,
                                           target.max_model_len, gemm=cfg.device.cpu_gemm)
        return cls(draft, cfg, target.config.vocab_size)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def propose(self, v: dict[str, torch.Tensor], desc: LaunchDescriptor) -> None:
        """Run the draft over the launch whose inputs are ``v`` and write its proposals into the
        proposal rows of ``v["token_ids"]``."""
        dims, nd = desc.dims, desc.num_decode
        b, bd, s = dims["B"], dims["BD"], dims["S"]
        ids = v["token_ids"]
        rows = v["draft_rows"]
        nd_kept = nd - (b - bd)  # proposal rows are decode rows: the kept decode rows come first
        dev = ids.device
        tokens = torch.cat([rows[:nd_kept], torch.arange(nd, ids.shape[0], device=dev)])
        qsl = v["query_start_loc"]
        starts = torch.cat([torch.arange(nd_kept + 1, dtype=qsl.dtype, device=dev), qsl[nd + 1 :] - (b - bd)])
        first_pass = ForwardBatch(ids.index_select(0, tokens), v["positions"].index_select(0, tokens),
                                  v["slot_mapping"].index_select(0, tokens), starts,
                                  v["seq_lens"].index_select(0, rows),
                                  v["block_tables"].index_select(0, rows), nd_kept,
                                  desc.prompt_query_lens, desc.prompt_seq_lens)
        x = self.model.forward(first_pass, self.kv, self.ws, None)
        if not s:
            return
        spec = v["spec_rows"]
        first, real = request_rows(spec)
        last = spec.max(dim=1).values
        logits = self.logits[:s]
        self.model.compute_logits(x, v["draft_leads"], logits, self.ws)
        step_starts = torch.arange(s + 1, dtype=qsl.dtype, device=dev)
        for c in range(1, spec.shape[1]):
            proposal = torch.argmax(logits, dim=1).to(ids.dtype)
            # Column c's rows get the proposal; a shorter request's padding rewrites its first row's own id.
            ids.scatter_(0, torch.where(real[:, c], spec[:, c], first),
                         torch.where(real[:, c], proposal, ids.index_select(0, first)))
            col = torch.where(real[:, c], spec[:, c], last)
            step = ForwardBatch(ids.index_select(0, col), v["positions"].index_select(0, col),
                                v["slot_mapping"].index_select(0, col), step_starts,
                                v["seq_lens"].index_select(0, col), v["block_tables"].index_select(0, col), s)
            self.model.forward(step, self.kv, self.ws, logits if c + 1 < spec.shape[1] else None)
