"""A launch's sampled ids out to each request: its tokens, text deltas, logprobs and finish.

The host half of a step after the launch, written once for the server and the offline
engine: record prompt logprobs, append the token, advance the grammar, extend the text and
match stop strings (O(new characters) per token, ``stop_strings.py``), check stop ids, EOS
and length, and tell the scheduler which requests finished. It runs on the coordinator's
loop thread, between reading one launch's ids and scheduling the next; with async scheduling
the device meanwhile runs the launch after it, so this time hides behind the device's.

A row that raises fails alone: its request ends with an error event and the other rows go
on (one request must never stop a worker's loop).
"""

from __future__ import annotations

import logging

from fusedserve.coordinator.engine.scheduled_batch import ScheduledBatch
from fusedserve.coordinator.engine.sequence import Sequence, TokenEvent
from fusedserve.coordinator.engine.step_outputs import StepOutputs
from fusedserve.coordinator.errors import RequestError

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def process(self, batch: ScheduledBatch, rows: list[int], out: StepOutputs) -> list[TokenEvent]:
        """Events for ``rows`` of the launch (those the scheduler still holds)."""
        events = []
        for row in rows:
            seq = batch.seqs[row]
            try:
                out.record_prompt_logprobs(row, seq)
                if not batch.samples[row]:
                    continue
                if seq.pooling:  # its prompt is done: the pooled row is its whole result
                    seq.pooled = out.pooled_row(row, seq.seq_id)
                    seq.finish_reason = "stop"
                    events.append(TokenEvent(seq, None, True))
                    continue
                for r in range(row, row + out.gained(row)):  # a speculating request's tokens in order
                    ev = self._append(seq, out.token(r, seq.seq_id), r, out)
                    events.append(ev)
                    if ev.finished:
                        break
            except RequestError as exc:  # a coded failure of this request (a grammar past its limits)
                log.warning("request %s failed: %s: %s", seq.seq_id, exc.code, exc)
                seq.finish_reason = "error"
                events.append(TokenEvent(seq, None, True, error=exc))
            except Exception as exc:  # noqa: BLE001 - isolated to this request
                log.exception("request %s failed while reading its token", seq.seq_id)
                seq.finish_reason = "error"
                events.append(TokenEvent(seq, None, True, error=RequestError(
                    "sampling_error", f"sampling failed: {type(exc).__name__}: {exc}")))
        return events

    def _append(self, seq: Sequence, token: int, row: int, out: StepOutputs) -> TokenEvent:
        if seq.grammar is not None:  # first: a token the grammar refuses never joins the output
            try:
                seq.grammar.accept(token)
            except ValueError as exc:  # the parser refused the token, or hit one of its limits
                raise RequestError("grammar_error", f"the constraint stopped at output token "
                                   f"{len(seq.output_ids)}: {str(exc).splitlines()[0]}") from None
        if seq.params.logprobs:
            lp, top = out.logprobs(row, seq.seq_id, seq.params.top_logprobs)
            seq.logprobs.append(lp)
            if seq.params.top_logprobs:
                seq.top_logprobs.append(top)
        seq.output_ids.append(token)
        if seq.detok is not None:
            seq.detok.push(token)
        seq.finish_reason = self._finish_reason(seq, token)
        finished = seq.finish_reason is not None
        text = ""
        if seq.detok is not None:
            if finished:
                seq.detok.finish()
            text = seq.detok.delta(final=finished)
        return TokenEvent(seq, token, finished, text, index=len(seq.output_ids) - 1)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.detok is not None and seq.detok.stopped:
            return "stop"
        if seq.grammar is not None and seq.grammar.done:
            return "stop"
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None
