"""When a request speculates: the batch gate and, per request, whether its proposals pay.

A speculating request cannot run a launch ahead (its proposals need its newest tokens on the host,
and how many a launch accepts is known only when it is read), so at batch 1 it gives up async
scheduling's overlap (a launch with speculating rows is read before the next is sent), and each
launch carries its k proposal rows. That pays only while the step is bound by reading the weights
(a worker holding at most ``speculative_max_batch`` requests, running or waiting) and while the
proposals are accepted. Each request keeps a running mean of the proposals it gained per launch; below
``MIN_GAIN`` it stops speculating (it runs ahead like any row) for a pause that doubles each time it
fails again (up to ``MAX_PAUSE`` launches), then probes once more. Free prose, where prompt lookup
rarely matches, thus runs as without speculation; a code edit keeps it on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fusedserve.coordinator.engine.speculative.device_proposer import DeviceProposer
from fusedserve.coordinator.engine.speculative.ngram_proposer import NgramProposer
from fusedserve.shared_memory.engine_config import EngineConfig

MIN_GAIN = 0.3  # accepted proposals per speculating launch below which it does not pay
FIRST_PAUSE = 4  # launches a request runs ahead after its first failed spell
MAX_PAUSE = 64
DECAY = 0.7  # weight of the running mean's past


@dataclass
class SpecState:
    """One request's record: its running gain and when it may speculate again."""

    gain: float = 1.0  # accepted proposals per speculating launch, running mean
    resume_at: int = 0  # the scheduler step from which it speculates again
    pause: int = FIRST_PAUSE

    def active(self, step: int) -> bool:
        return step >= self.resume_at

    def record(self, gained: int, step: int) -> None:
        """After a speculating launch (``gained`` accepted proposals; 0 when none were found)."""
        self.gain = DECAY * self.gain + (1 - DECAY) * gained
        if self.gain >= MIN_GAIN:
            if self.gain >= 2 * MIN_GAIN:
                self.pause = FIRST_PAUSE
            return
        self.resume_at = step + self.pause
        self.pause = min(2 * self.pause, MAX_PAUSE)
        self.gain = 2 * MIN_GAIN  # one more poor launch after the pause pauses it again


@dataclass
class SpecStats:
    """A worker's speculation counters (``stats``, Prometheus)."""

    drafts: int = 0  # launches in which a request carried proposals
    proposed: int = 0  # proposal rows verified
    accepted: int = 0  # of them, accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class Speculation:
    """One worker's speculation: its proposer (on the host, or rows reserved for the device's), k,
    the batch gate and its counters."""

    method: str
    proposer: NgramProposer | DeviceProposer
    k: int
    max_batch: int
    stats: SpecStats = field(default_factory=SpecStats)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> Speculation | None:
        sp = cfg.speculative
        if sp.speculative_method == "off":
            return None
        proposer = (DeviceProposer() if sp.speculative_method == "draft"
                    else NgramProposer(sp.prompt_lookup_max, sp.prompt_lookup_min))
        return cls(sp.speculative_method, proposer, sp.num_speculative_tokens, sp.speculative_max_batch)
