"""Proposals made on the device, inside the launch: the coordinator only reserves their rows.

With a draft model (``speculative_method draft``) each worker's ``worker/drafter.py`` runs the draft
over the launch and writes its proposals into the reserved rows' token ids before the target's
forward, so they never cross to the host; the verification keeps what the target's draws agree
with, and only accepted ids come back. An EAGLE or MTP head would fill the same rows the same way:
the scheduler, the launch shape and the verification do not change.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceProposer:
    on_device: bool = True

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """``k`` placeholder ids (the device writes the proposals over them)."""
        return [0] * max(k, 0)
