"""Runs launches for one device through the argument contract.

The runner owns what lives on the device (weights, paged KV cache, workspace, scratch
pool) and executes ``LaunchDescriptor``s against the host arena bank the coordinator
wrote: feed, one model forward, the sampler, asked-for logprobs. It is used in-process
by the offline engine and inside each Ray worker actor. Launches run in the order they
arrive, so the ids one launch samples are still in the pool's ``sampled_ids`` when the
next one starts: rows whose input the coordinator has not read yet are fed from there
(``feed_rows``).
"""

from __future__ import annotations

import torch

from fusedserve.kernels import sampler
from fusedserve.kernels.forward_batch import ForwardBatch
from fusedserve.kernels.penalties import PenaltyState, apply_logit_bias
from fusedserve.kernels.speculation import accept_prefix
from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.contract import LaunchDescriptor, LaunchReply
from fusedserve.shared_memory.engine_config import EngineConfig
from fusedserve.shared_memory.sampling_row import SamplingPlan
from fusedserve.shared_memory.slots import step_table
from fusedserve.worker.drafter import Drafter
from fusedserve.worker.graphs import DecodeGraphs
from fusedserve.worker.launch_runtime import LaunchRuntime
from fusedserve.worker.lora_pool import LoraPool
from fusedserve.worker.model.qwen3 import Qwen3Model
from fusedserve.worker.scratch_pool import DeviceScratchPool

# The slots a forward reads (the decode graphs capture the pool's tensors of these).
FORWARD_SLOTS = ("token_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables")


class ModelRunner:
    def __init__(self, model: Qwen3Model, cfg: EngineConfig, arenas: HostArena | list[HostArena],
                 writes_outputs: bool = True):
        """``cfg``: resolved for ``model``. ``writes_outputs``: False on a tensor-parallel rank other
        than 0, which computes the same outputs and leaves them on its device (rank 0 writes them)."""
        cfg.check()
        self.model = model
        self.cfg = cfg
        self.table = step_table()
        self.max_dims = cfg.max_dims(model.config.vocab_size)
        max_batch, block_size = cfg.scheduler.max_batch, cfg.cache.block_size
        self.candidates = cfg.device.sampler_candidates
        # One spare block beyond the allocatable ones: graph padding rows write there.
        self.kv = model.new_kv_cache(cfg.num_blocks + 1, block_size, cfg.cache.kv_cache_dtype, max_batch,
                                     cfg.cache.state_snapshots)
        self.hybrid = model.config.hybrid
        self.ws = model.new_workspace(max_batch, block_size, cfg.cache.kv_cache_dtype)
        self.pool = DeviceScratchPool(self.table, self.max_dims, model.device)
        # A pooling runner hands back its pooled rows alone: no ids are sampled.
        self.runtime = LaunchRuntime(self.table, arenas, self.pool, writes_outputs,
                                     unread=("sampled_ids",) if cfg.pooling else ())
        self.logits = self.pool.full("logits")
        dev = model.device  # the feed's scratch: no allocation per launch
        self._feed_idx = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self._feed_ids = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self._feed_mask = torch.zeros(max_batch, dtype=torch.bool, device=dev)
        # Prompt logprobs: their logits, max_batch tokens at a time.
        self._prompt_logits = torch.empty(max_batch, model.config.vocab_size, dtype=torch.float32, device=dev)
        self._masked: torch.Tensor | None = None  # processed logits, when logprobs need the raw ones
        # Penalties' token counts per slot (at most one slot per running sequence), made on first use.
        self.penalties = PenaltyState(max_batch, model.config.vocab_size, dev)
        # A draft model proposing inside the launch (speculative decoding), with its own KV cache.
        self.drafter = Drafter.load(cfg, model)
        # A pooling runner: prompts in, each finished prompt's pooled row out; nothing is sampled.
        self.pooling, self.score_tokens = cfg.pooling, cfg.model.score_tokens
        # LoRA adapters' slots (--max-loras), filled as launches name them.
        self.loras = (LoraPool(model, cfg.lora, cfg.scheduler.max_num_batched_tokens) if cfg.lora.enable_lora
                      else None)
        self.graphs: DecodeGraphs | None = None
        # A Qwen3-MoE layer reads its routing back to the host: no device graph can capture it.
        # Tensor-parallel ranks run eagerly too (collectives in a captured graph: not yet checked).
        # So do the Ascend fused kernels, whose attention takes the lengths as host lists.
        # A hybrid's prompt chunks index their states from host lists: eager too (not yet captured).
        has_graphs = (model.device.type in ("cuda", "npu") and not model.config.num_experts
                      and model.tp.size == 1 and model.kernels.capturable and not self.hybrid)
        # LoRA rows are grouped per adapter from the launch's slots: not captured either.
        graphs = "off" if self.hybrid or self.loras is not None else cfg.device.graphs
        if not self.pooling and (graphs == "padded" or (graphs == "auto" and has_graphs)):
            inputs = {name: self.pool.full(name) for name in FORWARD_SLOTS}
            self.graphs = DecodeGraphs(model, self.kv, self.ws, self.logits, inputs, cfg.pad_slot,
                                       self._sample_rows, capture=graphs == "auto")
        self.warmup()

    def warmup(self) -> None:
        """One throwaway decode row (K/V into the spare slot): first-call costs (kernel
        selection, page faults in the workspace) happen before the first request."""
        dev = self.model.device
        zero = torch.zeros(1, dtype=torch.int32, device=dev)
        spare = torch.tensor([self.cfg.scheduler.max_batch], device=dev)  # a hybrid's spare state slot
        batch = ForwardBatch(zero, zero, torch.tensor([self.cfg.pad_slot], device=dev),
                             torch.tensor([0, 1], dtype=torch.int32, device=dev),
                             torch.ones(1, dtype=torch.int32, device=dev), zero.view(1, 1), num_decode=1,
                             state_slots=spare if self.hybrid else None)
        self.model.forward(batch, self.kv, self.ws, None if self.pooling else self.logits[:1])

    def close(self) -> None:
        """Hand back what outlives the runner otherwise: the arena banks' page-locking."""
        self.runtime.close()

    def execute(self, desc: LaunchDescriptor) -> LaunchReply:
        moved = self.loras.load(desc.lora_loads) if desc.lora_loads else 0  # adapters into their slots
        rec = self.runtime.launch(desc.dims, lambda v: self._step(v, desc), desc.bank, desc.num_decode, moved)
        return rec.reply()

    def _feed(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """``ids[r] = previous launch's sampled_ids[rows[r]]`` where ``rows[r] >= 0`` (decode rows
        come first, so row r's token is ``ids[r]``)."""
        n = rows.shape[0]
        idx, vals, mask = self._feed_idx[:n], self._feed_ids[:n], self._feed_mask[:n]
        torch.clamp(rows, min=0, out=idx)
        torch.index_select(self.pool.full("sampled_ids"), 0, idx, out=vals)
        torch.ge(rows, 0, out=mask)
        torch.where(mask, vals, ids[:n], out=ids[:n])

    def _step(self, v: dict[str, torch.Tensor], desc: LaunchDescriptor) -> None:
        dims, b = desc.dims, desc.dims["B"]
        self._feed(v["token_ids"], v["feed_rows"])
        if self.drafter is not None:
            self.drafter.propose(v, desc)
        batch = ForwardBatch(v["token_ids"], v["positions"], v["slot_mapping"], v["query_start_loc"],
                             v["seq_lens"], v["block_tables"], desc.num_decode, desc.prompt_query_lens,
                             desc.prompt_seq_lens, *self._state_args(v, dims), desc.spec_groups,
                             lora_slots=v["lora_slots"] if dims["LT"] else None)
        if self.pooling:  # the prompts' K/V (and states), then the rows whose prompts ended here
            hidden = self.model.forward(batch, self.kv, self.ws, None)
            if dims["PL"]:
                last = v["query_start_loc"].index_select(0, v["pool_rows"] + 1) - 1
                self.model.pool(hidden, last, v["pooled"], self.ws, self.logits, self.score_tokens)
            return
        logits = self.logits[:b]
        hidden = None
        plan = SamplingPlan.of(desc.sampling)
        processed = dims["G"] or dims["PB"] or dims["LB"]  # the logits change before sampling
        if self.graphs is not None and batch.decode_only:
            if not (processed or dims["NL"] or dims["TL"]):  # one replay: forward and sampler
                self.graphs.run(b, plan)
                self._verify(v, dims, self.kv)
                return
            self.graphs.run(b, None)
        else:
            hidden = self.model.forward(batch, self.kv, self.ws, logits)
        if dims["PR"]:  # requests starting their first chunk: fresh counts
            self.penalties.reset(v["penalty_reset"])
        if dims["PT"]:
            self.penalties.count(v["token_ids"].index_select(0, v["penalty_token_index"]),
                                 v["penalty_token_code"])
        sampled = logits
        if processed and dims["NL"]:  # logprobs are the model's: process a copy
            if self._masked is None:
                self._masked = torch.empty_like(self.logits)
            sampled = self._masked[:b]
            sampled.copy_(logits)
        if dims["LB"]:
            apply_logit_bias(sampled, v["bias_rows"], v["bias_ids"], v["bias_values"])
        if dims["G"]:  # masked rows (a grammar, the request's own rules): applied here on the device
            self.model.kernels.ops.apply_token_bitmask(sampled, v["token_bitmask"])
        if dims["PB"]:
            self.penalties.apply(sampled, v["penalty_rows"], v["penalty_slots"], v["penalty_params"])
        self.model.kernels.sample(sampled, v["sampling_params"], v["sampling_seeds"], v["sampled_ids"], plan,
                       self.candidates)
        if dims["PB"]:
            picked = v["sampled_ids"].index_select(0, v["penalty_rows"])
            self.penalties.count_sampled(v["penalty_slots"], picked)
        if dims["NL"]:
            rows = v["logprob_rows"]
            sampler.token_logprobs(logits.index_select(0, rows), v["sampled_ids"].index_select(0, rows),
                                   v["sampled_logprobs"], v["top_logprob_ids"], v["top_logprob_values"])
        if dims["TL"]:
            self._prompt_logprobs(hidden, v)
        self._verify(v, dims, self.kv)

    @staticmethod
    def _state_args(v: dict[str, torch.Tensor], dims: dict[str, int]) -> tuple:
        """A hybrid's rows' state slots, resets, snapshot restores and saves (else None)."""
        if not dims["RS"]:
            return None, None, None, None
        return v["state_slots"], v["state_resets"], v["state_restores"], v["state_saves"]

    @staticmethod
    def _verify(v: dict[str, torch.Tensor], dims: dict[str, int], kv) -> None:
        """Speculating requests keep the prefix of their proposals their own draws agree with
        (after logprobs, which every row's draw has)."""
        if dims["S"]:
            accept_prefix(v["sampled_ids"], v["token_ids"], v["spec_rows"], v["spec_accepted"])
            if dims["RS"]:  # a hybrid: each speculating request keeps the state of its accepted tokens
                kv.keep_accepted(v["state_slots"].index_select(0, v["spec_rows"][:, 0]), v["spec_accepted"])

    def _sample_rows(self, n: int, plan: SamplingPlan) -> None:
        """The sampler over the first ``n`` rows of the pool (what a decode graph captures)."""
        pool = self.pool
        self.model.kernels.sample(self.logits[:n], pool.full("sampling_params")[:n],
                                  pool.full("sampling_seeds")[:n], pool.full("sampled_ids")[:n], plan,
                                  self.candidates)

    def _prompt_logprobs(self, hidden: torch.Tensor, v: dict[str, torch.Tensor]) -> None:
        """The next prompt token's logprob at each asked token, ``max_batch`` tokens at a time."""
        index, targets = v["prompt_logprob_index"], v["prompt_logprob_targets"]
        step = self._prompt_logits.shape[0]
        for s in range(0, index.shape[0], step):
            e = min(s + step, index.shape[0])
            logits = self._prompt_logits[: e - s]
            self.model.compute_logits(hidden, index[s:e], logits, self.ws)
            sampler.token_logprobs(logits, targets[s:e], v["prompt_logprobs"][s:e], v["prompt_top_ids"][s:e],
                                   v["prompt_top_values"][s:e])
