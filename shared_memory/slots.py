"""Declared launch arguments: the single source of truth for what a launch touches.

Every tensor a launch reads or writes is a ``Slot`` with a symbolic shape, a dtype, a
direction and a placement. ``HOST_SHARED`` slots live in the coordinator's shared-memory
arena and cross host<->device around each launch; ``DEVICE_RESIDENT`` slots live in the
worker's scratch pool and never move. There is one launch shape (``step_table``).

Dimensions: B rows (sequences), B1 = B + 1, T packed tokens, W block-table width, NL rows
asking for logprobs, N top logprobs per such row, TL prompt tokens asking for their
logprob, NP top logprobs per such token, V vocabulary, G rows of token bitmask (B when a row
of the launch samples under a mask, else 0), VW = ceil(V / 32) bitmask words per row; for
penalties, PR slots reset, PT tokens counted, PB rows penalized; LB logit-bias entries; S
speculating requests, K1 rows of one (its newest token and its proposals), BD rows a draft model's
first pass reads; PL rows pooled, H floats each (a pooling runner); LT tokens with an adapter
slot (LoRA).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from fusedserve.shared_memory.sampling_row import COLUMNS

MAX_TOP_LOGPROBS = 20  # N and NP at most (coordinator.sampling_params refuses more)
MAX_LOGIT_BIAS = 300  # logit_bias entries of one request (OpenAI's limit): LB is at most B times this


def bitmask_words(vocab: int) -> int:
    """VW: int32 words of one row's token bitmask (bit v % 32 of word v // 32 allows token v)."""
    return -(-vocab // 32)


def table_width(max_model_len: int, block_size: int) -> int:
    """W at most: the blocks of a sequence as long as the model allows."""
    return -(-max_model_len // block_size)


class Placement(Enum):
    HOST_SHARED = "host_shared"
    DEVICE_RESIDENT = "device_resident"


class Direction(Enum):
    IN = "in"
    OUT = "out"
    INOUT = "inout"


class SlotError(ValueError):
    """A tensor does not match its slot's declaration, or a dimension is unknown."""


Dim = str | int


def front_view(full: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """The first ``prod(shape)`` elements of a max-sized slot tensor, shaped ``shape``
    (contiguous, no copy): how a launch with smaller dims uses buffers sized once."""
    n = 1
    for d in shape:
        n *= d
    if len(shape) != full.dim() or any(d > m for d, m in zip(shape, full.shape)):
        raise SlotError(f"slot {name!r}: shape {shape} exceeds the allocated {tuple(full.shape)}")
    return full.view(-1)[:n].view(shape)


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[Dim, ...]
    dtype: torch.dtype
    direction: Direction
    placement: Placement

    def concrete(self, dims: dict[str, int]) -> tuple[int, ...]:
        try:
            return tuple(d if isinstance(d, int) else dims[d] for d in self.shape)
        except KeyError as exc:
            raise SlotError(f"slot {self.name!r}: dimension {exc.args[0]!r} not given") from None

    def nbytes(self, dims: dict[str, int]) -> int:
        n = self.dtype.itemsize
        for d in self.concrete(dims):
            n *= d
        return n

    @property
    def host_shared(self) -> bool:
        return self.placement is Placement.HOST_SHARED

    @property
    def reads(self) -> bool:
        return self.direction in (Direction.IN, Direction.INOUT)

    @property
    def writes(self) -> bool:
        return self.direction in (Direction.OUT, Direction.INOUT)

    def check(self, tensor: torch.Tensor, dims: dict[str, int]) -> None:
        """Raise SlotError naming the slot if ``tensor`` is not its declared shape/dtype."""
        want = self.concrete(dims)
        if tuple(tensor.shape) != want:
            raise SlotError(f"slot {self.name!r}: shape {tuple(tensor.shape)} != declared {want}")
        if tensor.dtype != self.dtype:
            raise SlotError(f"slot {self.name!r}: dtype {tensor.dtype} != declared {self.dtype}")


class SlotTable:
    """An ordered, named set of slots for one kind of launch."""

    def __init__(self, name: str, slots: list[Slot]):
        names = [s.name for s in slots]
        if len(set(names)) != len(names):
            raise SlotError(f"table {name!r}: duplicate slot names")
        self.name = name
        self.slots = list(slots)
        self._by_name = {s.name: s for s in slots}

    def __getitem__(self, name: str) -> Slot:
        try:
            return self._by_name[name]
        except KeyError:
            raise SlotError(f"table {self.name!r} has no slot {name!r}") from None

    def __iter__(self):
        return iter(self.slots)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def host_inputs(self) -> list[Slot]:
        return [s for s in self.slots if s.host_shared and s.reads]

    def host_outputs(self) -> list[Slot]:
        return [s for s in self.slots if s.host_shared and s.writes]


HS, DR = Placement.HOST_SHARED, Placement.DEVICE_RESIDENT
IN, OUT = Direction.IN, Direction.OUT
i32, i64, f32 = torch.int32, torch.int64, torch.float32


def step_table() -> SlotTable:
    """Every launch: packed tokens with decode rows first, then prompt chunks (vLLM V1's
    phase-less batch), and what the sampler hands back."""
    return SlotTable(
        "step",
        [
            Slot("token_ids", ("T",), i32, IN, HS),
            Slot("positions", ("T",), i32, IN, HS),
            Slot("slot_mapping", ("T",), i64, IN, HS),  # where each token's K/V is written
            Slot("query_start_loc", ("B1",), i32, IN, HS),  # row r's tokens: [qsl[r], qsl[r + 1])
            Slot("seq_lens", ("B",), i32, IN, HS),  # each row's context after the launch
            Slot("block_tables", ("B", "W"), i32, IN, HS),
            # Row of the previous launch whose sampled id (still on the device) is this decode
            # row's input, or -1: ``token_ids`` holds it (async scheduling).
            Slot("feed_rows", ("B",), i32, IN, HS),
            # Per row: its settings in ``sampling_row.COLUMNS``' order, and (seed, step).
            Slot("sampling_params", ("B", len(COLUMNS)), f32, IN, HS),
            Slot("sampling_seeds", ("B", 2), i64, IN, HS),
            Slot("logprob_rows", ("NL",), i64, IN, HS),
            # Prompt logprobs: the tokens whose next prompt token's logprob is asked, and it.
            Slot("prompt_logprob_index", ("TL",), i64, IN, HS),
            Slot("prompt_logprob_targets", ("TL",), i64, IN, HS),
            # Structured outputs, allowed_token_ids, bad_words, min_tokens: bit v of row r allows token v
            # (a row without a mask: all set).
            Slot("token_bitmask", ("G", "VW"), i32, IN, HS),
            # Penalties (kernels/penalties.py): slots to zero, chunk tokens to count (their index in
            # token_ids, and slot * 2 + is_output), the penalized rows, their slots and settings.
            Slot("penalty_reset", ("PR",), i64, IN, HS),
            Slot("penalty_token_index", ("PT",), i64, IN, HS),
            Slot("penalty_token_code", ("PT",), i64, IN, HS),
            Slot("penalty_rows", ("PB",), i64, IN, HS),
            Slot("penalty_slots", ("PB",), i64, IN, HS),
            Slot("penalty_params", ("PB", 3), f32, IN, HS),  # presence, frequency, repetition
            # logit_bias: logits[bias_rows[i], bias_ids[i]] += bias_values[i].
            Slot("bias_rows", ("LB",), i64, IN, HS),
            Slot("bias_ids", ("LB",), i64, IN, HS),
            Slot("bias_values", ("LB",), f32, IN, HS),
            # Speculative decoding: each speculating request's rows (its newest token's, then one per
            # proposal, consecutive decode rows; padded with its first row). Row j + 1's token is the
            # proposal that row j's draw verifies.
            Slot("spec_rows", ("S", "K1"), i64, IN, HS),
            # A draft model on the device: the rows of its first pass (all but proposal rows), and
            # each speculating request's first row's index among them.
            Slot("draft_rows", ("BD",), i64, IN, HS),
            Slot("draft_leads", ("S",), i64, IN, HS),
            # A hybrid model's rows: each one's recurrent-state slot, and the slots starting afresh.
            Slot("state_slots", ("RS",), i64, IN, HS),
            Slot("state_resets", ("SR",), i64, IN, HS),
            Slot("state_restores", ("SRS", 2), i64, IN, HS),  # (snapshot, state slot): a cached prefix's
            Slot("state_saves", ("SSV", 2), i64, IN, HS),  # (state slot, snapshot) at a block boundary
            # A pooling runner: the rows whose prompt ends in this launch, and what each pools (its last
            # token's final hidden state, or its score head's logits), float32 as the API serves it.
            Slot("pool_rows", ("PL",), i64, IN, HS),
            Slot("pooled", ("PL", "H"), f32, OUT, HS),
            # LoRA: each token's adapter slot in the worker's pool (-1: the base model); LT is T when a
            # row of the launch has an adapter, else 0 (nothing crosses).
            Slot("lora_slots", ("LT",), i32, IN, HS),
            Slot("sampled_ids", ("B",), i32, OUT, HS),  # -1 on a speculating request's rejected rows
            Slot("spec_accepted", ("S",), i32, OUT, HS),  # tokens each speculating request gained

            Slot("sampled_logprobs", ("NL",), f32, OUT, HS),
            Slot("top_logprob_ids", ("NL", "N"), i32, OUT, HS),
            Slot("top_logprob_values", ("NL", "N"), f32, OUT, HS),
            Slot("prompt_logprobs", ("TL",), f32, OUT, HS),
            Slot("prompt_top_ids", ("TL", "NP"), i32, OUT, HS),
            Slot("prompt_top_values", ("TL", "NP"), f32, OUT, HS),
            Slot("logits", ("B", "V"), f32, OUT, DR),  # each row's last token's, for the sampler
        ],
    )
