"""Coordinator side of the argument contract: write a launch's inputs, read its outputs.

One way each: ``write_batch`` puts a frozen ``ScheduledBatch`` into an arena bank's input slots
and returns the ``LaunchDescriptor`` and the ``OutputPlan`` (what will come back, and which rows
could not be written); ``read_outputs`` reads only output slots, as numpy views of the same
shared memory, valid until the next launch on that bank. Inputs go straight into the arena
views (no intermediate buffers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fusedserve.coordinator.engine.scheduled_batch import PromptSpan, ScheduledBatch
from fusedserve.coordinator.engine.step_outputs import StepOutputs
from fusedserve.coordinator.errors import RequestError
from fusedserve.coordinator.structured.grammar_state import fill_rows
from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.contract import LaunchDescriptor
from fusedserve.shared_memory.sampling_row import COLUMNS, SamplingPlan, row_values
from fusedserve.shared_memory.slots import bitmask_words


@dataclass(frozen=True)
class OutputPlan:
    """What a launch hands back, known when it is written: the rows whose logprobs come back (in
    the order of the logprob slots), the prompt-logprob spans, and rows whose settings never
    reached the device (each fails alone when read)."""

    logprob_rows: tuple[int, ...] = ()
    pool_rows: tuple[int, ...] = ()  # rows whose pooled output comes back, in ``pooled``'s order
    spec_firsts: tuple[int, ...] = ()  # speculating requests' first rows, in ``spec_accepted``'s order
    prompt_spans: tuple[PromptSpan, ...] = ()
    invalid: dict[int, RequestError] = field(default_factory=dict)


def _put(arena: HostArena, name: str, values: np.ndarray) -> None:
    arena.array(name, values.shape)[...] = values


def write_batch(arena: HostArena, batch: ScheduledBatch, step: int, bank: int, candidates: int,
                vocab: int,
                penalty_slots: dict[int, int] | None = None,
                state_slots: dict[int, int] | None = None,
                state_copies: tuple[list, list] | None = None,
                pooled_width: int = 0, loras: tuple[list[int] | None, list[list]] = (None, []),
                ) -> tuple[LaunchDescriptor, OutputPlan]:
    """``arena`` is bank ``bank`` of the worker's; ``candidates``: the sampler's candidate count;
    ``penalty_slots``: each penalized row's slot of the worker's token counts; ``state_slots``:
    each row's recurrent-state slot (a hybrid model's; None otherwise); ``state_copies``: its
    snapshots restored before the launch and saved after it (``StateSnapshots.plan``);
    ``pooled_width``: a pooling runner's floats per pooled row; ``loras``: each row's LoRA slot (None:
    no row has one) and the adapters to read into slots first (``LoraSlots.assign``)."""
    b, nd = batch.batch_size, batch.num_decode
    dims = {"B": b, "B1": b + 1, "T": batch.num_tokens, "W": batch.block_tables.shape[1], "V": vocab}
    _put(arena, "token_ids", batch.token_ids)
    _put(arena, "positions", batch.positions)
    _put(arena, "slot_mapping", batch.slot_mapping)
    _put(arena, "query_start_loc", batch.query_start_loc)
    _put(arena, "seq_lens", batch.seq_lens)
    _put(arena, "block_tables", batch.block_tables)
    _put(arena, "feed_rows", batch.feed_rows)
    invalid: dict[int, RequestError] = {}
    plan, rows = _write_sampling(arena, batch, dims, candidates, vocab, invalid)
    _write_bitmask(arena, batch, dims, vocab, invalid)
    _write_penalties(arena, batch, dims, penalty_slots or {})
    _write_states(arena, batch, dims, state_slots, state_copies or ([], []))
    _write_logit_bias(arena, batch, dims)
    spans = _write_prompt_logprobs(arena, batch, dims)
    firsts = _write_spec_rows(arena, batch, dims)
    pooled = [r for r, seq in enumerate(batch.seqs) if seq.pooling and batch.samples[r]]
    dims["PL"], dims["H"] = len(pooled), pooled_width
    _put(arena, "pool_rows", np.asarray(pooled, dtype=np.int64))
    rows_slots, loads = loras
    tokens = [] if rows_slots is None else np.repeat(np.asarray(rows_slots, dtype=np.int32), batch.query_lens)
    dims["LT"] = len(tokens)
    _put(arena, "lora_slots", np.asarray(tokens, dtype=np.int32))
    desc = LaunchDescriptor(dims, step, bank, num_decode=nd, prompt_query_lens=list(batch.query_lens[nd:]),
                            prompt_seq_lens=batch.seq_lens[nd:].tolist(), sampling=plan.stages(),
                            spec_groups=[[first, n] for first, n in batch.spec_groups], lora_loads=loads)
    return desc, OutputPlan(tuple(rows), tuple(pooled), firsts, tuple(spans), invalid)


def _write_sampling(arena: HostArena, batch: ScheduledBatch, dims: dict[str, int], candidates: int,
                    vocab: int, invalid: dict[int, RequestError]) -> tuple[SamplingPlan, list[int]]:
    """Each row's sampling settings, which rows want logprobs (and how many), and the plan."""
    b = batch.batch_size
    f32 = np.zeros((b, len(COLUMNS)), dtype=np.float32)
    seeds = np.zeros((b, 2), dtype=np.int64)
    rows, n = [], 0
    for i, seq in enumerate(batch.seqs):
        p = seq.params
        try:
            f32[i] = row_values(p)
            seeds[i] = (p.seed & 0x7FFF_FFFF_FFFF_FFFF, batch.draw_steps[i])
        except (TypeError, ValueError, OverflowError) as exc:  # a bug past validation: this row alone
            f32[i], seeds[i] = 0, 0
            invalid[i] = RequestError("sampling_error", f"sampling parameters {p!r} cannot be sent to the "
                                      f"device: {exc}")
            continue
        if p.logprobs:
            rows.append(i)
            n = max(n, p.top_logprobs)
    dims["NL"], dims["N"] = len(rows), n
    _put(arena, "sampling_params", f32)
    _put(arena, "sampling_seeds", seeds)
    _put(arena, "logprob_rows", np.asarray(rows, dtype=np.int64))
    return SamplingPlan.for_rows(f32, candidates, vocab), rows


def _write_bitmask(arena: HostArena, batch: ScheduledBatch, dims: dict[str, int], vocab: int,
                   invalid: dict[int, RequestError]) -> None:
    """Each masked row's allowed next tokens as bits (B rows when any row samples under a mask,
    else none): its grammar's (the matchers write straight into the arena bank), narrowed by its
    own rules (allowed_token_ids, bad_words, min_tokens)."""
    words = bitmask_words(vocab)
    ruled = [i for i, s in enumerate(batch.seqs)
             if batch.samples[i] and s.rules is not None and s.rules.applies(batch.draw_steps[i])]
    rows = [i for i, s in enumerate(batch.seqs) if s.grammar is not None and batch.samples[i]]
    dims["G"], dims["VW"] = (batch.batch_size if rows or ruled else 0), words
    if not rows and not ruled:
        return
    mask = arena.array("token_bitmask", (batch.batch_size, words))
    mask.fill(-1)
    speculating = {first: n for first, n in batch.spec_groups if batch.seqs[first].grammar is not None}
    _fill_grammars(batch, [i for i in rows if i not in speculating and not batch.follows(i)], mask, invalid)
    for first, n in speculating.items():  # each proposal row after the proposals before it
        proposals = batch.token_ids[first + 1 : first + n].tolist()
        try:
            batch.seqs[first].grammar.fill_proposals(mask, first, proposals)
        except Exception as exc:  # noqa: BLE001 - this request alone
            mask[first : first + n] = -1
            why = f"the grammar could not give its next tokens: {exc}"
            invalid[first] = RequestError("grammar_error", why)
    for i in ruled:
        seq = batch.seqs[i]
        seq.rules.apply(mask[i].view(np.uint32), seq.output_ids, batch.draw_steps[i])


def _fill_grammars(batch: ScheduledBatch, rows: list[int], mask: np.ndarray,
                   invalid: dict[int, RequestError]) -> None:
    if not rows:
        return
    try:
        fill_rows([(batch.seqs[i].grammar, i) for i in rows], mask)
    except Exception:  # noqa: BLE001 - row by row, so that a matcher that fails fails its row alone
        for i in rows:
            try:
                batch.seqs[i].grammar.fill(mask, i)
            except Exception as exc:  # noqa: BLE001
                mask[i] = -1
                why = f"the grammar could not give its next tokens: {exc}"
                invalid[i] = RequestError("grammar_error", why)


def _write_penalties(arena: HostArena, batch: ScheduledBatch, dims: dict[str, int],
                     slots: dict[int, int]) -> None:
    """Penalized rows: the slots their first chunks reset, every chunk token counted into its slot
    (an output token where its position is past the prompt: a recomputed request rebuilds its
    counts), and the rows that sample with their slots and settings."""
    reset, index, codes, rows, params = [], [], [], [], []
    starts = batch.query_start_loc
    for row, slot in slots.items():
        seq = batch.seqs[row]
        if row >= batch.num_decode:  # a chunk: count its tokens
            first = batch.chunk_start(row)
            if first == 0:
                reset.append(slot)
            n, prompt = batch.query_lens[row], len(seq.prompt_ids)
            index.extend(range(int(starts[row]), int(starts[row]) + n))
            codes.extend(slot * 2 + (first + k >= prompt) for k in range(n))
        if batch.samples[row]:
            p = seq.params
            rows.append(row)
            params.append((p.presence_penalty, p.frequency_penalty, p.repetition_penalty))
    dims["PR"], dims["PT"], dims["PB"] = len(reset), len(index), len(rows)
    _put(arena, "penalty_reset", np.asarray(reset, dtype=np.int64))
    _put(arena, "penalty_token_index", np.asarray(index, dtype=np.int64))
    _put(arena, "penalty_token_code", np.asarray(codes, dtype=np.int64))
    _put(arena, "penalty_rows", np.asarray(rows, dtype=np.int64))
    _put(arena, "penalty_slots", np.asarray([slots[r] for r in rows], dtype=np.int64))
    _put(arena, "penalty_params", np.asarray(params, dtype=np.float32).reshape(len(rows), 3))


def _write_states(arena: HostArena, batch: ScheduledBatch, dims: dict[str, int],
                  slots: dict[int, int] | None, copies: tuple[list, list]) -> None:
    """Each row's recurrent-state slot, the slots of rows whose first chunk this launch carries
    from the start (zeroed before it runs), and the snapshot copies."""
    rows = [] if slots is None else [slots[r] for r in range(batch.batch_size)]
    resets = [] if slots is None else [slots[r] for r in range(batch.num_decode, batch.batch_size)
                                       if batch.chunk_start(r) == 0]
    restores, saves = copies
    dims["RS"], dims["SR"], dims["SRS"], dims["SSV"] = len(rows), len(resets), len(restores), len(saves)
    _put(arena, "state_slots", np.asarray(rows, dtype=np.int64))
    _put(arena, "state_resets", np.asarray(resets, dtype=np.int64))
    _put(arena, "state_restores", np.asarray(restores, dtype=np.int64).reshape(len(restores), 2))
    _put(arena, "state_saves", np.asarray(saves, dtype=np.int64).reshape(len(saves), 2))


def _write_logit_bias(arena: HostArena, batch: ScheduledBatch, dims: dict[str, int]) -> None:
    """Every (row, token, value) of the sampling rows' logit_bias."""
    entries = [(row, t, v) for row, seq in enumerate(batch.seqs) if batch.samples[row]
               for t, v in seq.params.logit_bias.items()]
    dims["LB"] = len(entries)
    cols = list(zip(*entries)) if entries else [(), (), ()]
    _put(arena, "bias_rows", np.asarray(cols[0], dtype=np.int64))
    _put(arena, "bias_ids", np.asarray(cols[1], dtype=np.int64))
    _put(arena, "bias_values", np.asarray(cols[2], dtype=np.float32))


def _write_prompt_logprobs(arena: HostArena, batch: ScheduledBatch, dims: dict[str, int]) -> list[PromptSpan]:
    """For rows asking prompt logprobs: each chunk token whose next token is still the prompt's."""
    index, targets, spans, n = [], [], [], 0
    starts = batch.query_start_loc
    for row in range(batch.num_decode, batch.batch_size):
        seq = batch.seqs[row]
        if seq.params.prompt_logprobs is None:
            continue
        first = batch.chunk_start(row)
        count = max(0, min(first + batch.query_lens[row], len(seq.prompt_ids) - 1) - first)
        if not count:
            continue
        spans.append(PromptSpan(row, len(index), count, first))
        index.extend(range(int(starts[row]), int(starts[row]) + count))
        targets.extend(seq.prompt_ids[first + 1 : first + 1 + count])
        n = max(n, seq.params.prompt_logprobs)
    dims["TL"], dims["NP"] = len(index), n
    _put(arena, "prompt_logprob_index", np.asarray(index, dtype=np.int64))
    _put(arena, "prompt_logprob_targets", np.asarray(targets, dtype=np.int64))
    return spans


def _write_spec_rows(arena: HostArena, batch: ScheduledBatch, dims: dict[str, int]) -> tuple[int, ...]:
    """Each speculating request's rows, padded with its first (``kernels/speculation.py``)."""
    width = max((n for _, n in batch.spec_groups), default=1)
    table = np.empty((len(batch.spec_groups), width), dtype=np.int64)
    for i, (first, n) in enumerate(batch.spec_groups):
        table[i] = first
        table[i, :n] = np.arange(first, first + n)
    dims["S"], dims["K1"] = table.shape
    _put(arena, "spec_rows", table)
    firsts = tuple(first for first, _ in batch.spec_groups)
    kept = [r for r in range(batch.batch_size) if not batch.follows(r)] if batch.device_proposals else []
    dims["BD"] = len(kept)
    _put(arena, "draft_rows", np.asarray(kept, dtype=np.int64))
    leads = [kept.index(f) for f in firsts] if kept else [0] * len(firsts)
    _put(arena, "draft_leads", np.asarray(leads, dtype=np.int64))
    return firsts


def read_outputs(arena: HostArena, desc: LaunchDescriptor, plan: OutputPlan) -> StepOutputs:
    """The launch's output slots (and nothing else) as numpy views of its bank."""
    d = desc.dims
    nl, n, tl, np_ = d["NL"], d["N"], d["TL"], d["NP"]
    return StepOutputs(
        step=desc.step,
        sampled_ids=arena.array("sampled_ids", (d["B"],)),
        spec_firsts=list(plan.spec_firsts),
        spec_accepted=arena.array("spec_accepted", (d["S"],)),
        logprob_rows=list(plan.logprob_rows),
        sampled_logprobs=arena.array("sampled_logprobs", (nl,)),
        top_logprob_ids=arena.array("top_logprob_ids", (nl, n)),
        top_logprob_values=arena.array("top_logprob_values", (nl, n)),
        prompt_spans=list(plan.prompt_spans),
        prompt_logprobs=arena.array("prompt_logprobs", (tl,)),
        prompt_top_ids=arena.array("prompt_top_ids", (tl, np_)),
        prompt_top_values=arena.array("prompt_top_values", (tl, np_)),
        invalid=plan.invalid,
        pool_rows=list(plan.pool_rows),
        pooled=arena.array("pooled", (d["PL"], d["H"])),
    )
