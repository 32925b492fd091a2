"""A hybrid model's device cache: paged K/V for its full-attention layers only, and a recurrent
state per sequence slot for each linear-attention layer (vLLM's hybrid cache, in two pools).

A state slot is a running sequence's for its whole stay (the coordinator's ``SequenceSlots``
gives it when the sequence first runs and takes it back when it no longer does); the launch that
carries a sequence's first chunk zeroes it (``reset``). Slot ``slots - 1`` is a spare, which
warm-up rows use. States are float32 for the delta rule (transformers keeps them so) and the
model's dtype for the conv's last inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fusedserve.kernels.kv_cache import PagedKVCache
from fusedserve.kernels.model_description.config import Qwen3Config


@dataclass
class LayerState:
    conv: torch.Tensor  # [slots, conv channels, kernel - 1]: each sequence's last inputs
    recurrent: torch.Tensor  # [slots, value heads, key_head_dim, value_head_dim] float32


class HybridKVCache(PagedKVCache):
    def __init__(self, config: Qwen3Config, num_blocks: int, block_size: int, slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", kv_cache_dtype: str = "auto", snapshots: int = 0):
        attention = dataclasses.replace(config, num_hidden_layers=len(config.attention_layers))
        super().__init__(attention, num_blocks, block_size, dtype, device, kv_cache_dtype)
        la = config.linear_attention
        self._kv_index = {layer: i for i, layer in enumerate(config.attention_layers)}
        self._state_index = {layer: i for i, layer in enumerate(config.linear_layers)}
        n = len(config.linear_layers)
        self.conv = torch.zeros(n, slots, la.conv_dim, la.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(n, slots, la.num_value_heads, la.key_head_dim, la.value_head_dim,
                                     dtype=torch.float32, device=device)
        self.slots = slots
        self._window: tuple[torch.Tensor, torch.Tensor] | None = None  # speculating rows' states
        # Snapshots at block boundaries (prefix caching: coordinator/engine/state_snapshots.py).
        self.conv_snapshots = torch.zeros(n, snapshots, *self.conv.shape[2:], dtype=dtype, device=device)
        self.recurrent_snapshots = torch.zeros(n, snapshots, *self.recurrent.shape[2:], dtype=torch.float32,
                                               device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Model layer ``i``'s K and V (a full-attention layer's)."""
        return super().layer(self._kv_index[i])

    def state(self, i: int) -> LayerState:
        """Model layer ``i``'s states (a linear-attention layer's)."""
        j = self._state_index[i]
        return LayerState(self.conv[j], self.recurrent[j])

    def reset(self, slots: torch.Tensor) -> None:
        """Zero ``slots`` in every layer: their sequences start (their first chunk is in this launch)."""
        self.conv.index_fill_(1, slots, 0)
        self.recurrent.index_fill_(1, slots, 0)

    def speculating(self, i: int, groups: int, rows: int) -> LayerState:
        """Layer ``i``'s per-position states of this launch's speculating requests [groups, rows, ...]
        (state after j + 1 of a request's rows at [g, j]), kept until ``keep_accepted``."""
        j = self._state_index[i]
        if self._window is None or self._window[0].shape[1:3] != (groups, rows):
            n = len(self._state_index)
            self._window = (self.conv.new_empty(n, groups, rows, *self.conv.shape[2:]),
                            self.recurrent.new_empty(n, groups, rows, *self.recurrent.shape[2:]))
        return LayerState(self._window[0][j], self._window[1][j])

    def keep_accepted(self, slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """After verification: each speculating request's slot (``slots`` [G]) takes the state after
        its ``accepted`` [G] tokens (its newest and the proposals it kept), in every layer."""
        conv, rec = self._window
        g = torch.arange(slots.shape[0], device=slots.device)
        pick = accepted.long() - 1
        self.conv.index_copy_(1, slots, conv[:, g, pick])
        self.recurrent.index_copy_(1, slots, rec[:, g, pick])

    def restore(self, pairs: torch.Tensor) -> None:
        """``pairs`` [n, 2]: (snapshot, slot): each slot takes its snapshot's states."""
        self.conv.index_copy_(1, pairs[:, 1], self.conv_snapshots.index_select(1, pairs[:, 0]))
        self.recurrent.index_copy_(1, pairs[:, 1], self.recurrent_snapshots.index_select(1, pairs[:, 0]))

    def save(self, pairs: torch.Tensor) -> None:
        """``pairs`` [n, 2]: (slot, snapshot): each snapshot takes its slot's states."""
        self.conv_snapshots.index_copy_(1, pairs[:, 1], self.conv.index_select(1, pairs[:, 0]))
        self.recurrent_snapshots.index_copy_(1, pairs[:, 1], self.recurrent.index_select(1, pairs[:, 0]))

    @property
    def state_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent, self.conv_snapshots,
                                                           self.recurrent_snapshots))
