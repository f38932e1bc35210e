"""The sequences sampling requests returned, by ``sequence_id``, and a datum's provenance checked
against them.

A Tinker datum may say where its tokens came from (the SDK's ``Datum.with_provenance``): runs
that tile ``model_input`` (``model_input_spans``) and the loss rows, ``target_tokens``
(``loss_fn_input_spans``), each naming a sequence by the ``sequence_id`` its sampling request
returned. A ``prompt_tokens`` run is positions ``[offset, offset + length)`` of that request's
prompt, a ``sampled_tokens`` run the same positions of that sequence's sampled tokens. Tinker's
documentation: a training request can only name sequences sampled in its own session, and a
sequence can be trained on for one day after sampling, each training request that uses it
restarting the day.

``SequenceLog`` keeps, for every sequence id this server made, who sampled it (tenant and
session), its prompt's length, its sampled tokens' count (its ``max_tokens`` until the sample has
stopped), and when it was last used. ``SequenceLog.check`` refuses a request (a ``WireError`` naming the
datum, the span list, the span and the field) whose runs do not tile their field, or name a
sequence this server did not sample for this tenant (or no longer holds), one sampled in another
session, one past its day, or positions outside the sequence's prompt or sampled tokens; when
every datum passes, the day of each sequence named restarts. A datum without provenance is not
checked. The claimed tokens themselves are not compared (the log keeps no tokens).

In memory only: a restart forgets every sequence (a datum naming one is refused as unknown),
and the log holds at most ``max_sequences``, the least recently used dropped first.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tinker.proto import tinker_public_pb2 as pb

from harts.serve.wire import WireError

__all__ = ["MAX_SEQUENCES", "RETENTION_SECONDS", "SequenceLog"]

#: how long a sequence stays usable after its sampling or its last use in a training request
RETENTION_SECONDS = 24 * 3600.0
#: sequences the log holds at most (about 250 bytes each in CPython: some 60 MB when full)
MAX_SEQUENCES = 250_000


@dataclass(slots=True)
class _Sequence:
    tenant: str
    session_id: str
    prompt_length: int
    #: its sampled tokens' count once known, until then the request's max_tokens
    sampled: int
    last_used: float


class SequenceLog:
    """Sampled sequences by id (module docstring); thread-safe. ``clock`` gives seconds."""

    def __init__(
        self,
        *,
        retention_seconds: float = RETENTION_SECONDS,
        max_sequences: int = MAX_SEQUENCES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.retention_seconds = retention_seconds
        self.max_sequences = max(1, max_sequences)
        self._clock = clock
        self._lock = threading.Lock()
        #: least recently used first
        self._items: OrderedDict[str, _Sequence] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def record(self, ids: Sequence[str], *, tenant: str, session_id: str, prompt_length: int, max_tokens: int) -> None:
        """The sequences of one sampling request: ``ids`` (one per sample), sampled by ``tenant`` in
        ``session_id`` from a prompt of ``prompt_length`` tokens, each at most ``max_tokens`` long."""
        now = self._clock()
        with self._lock:
            self._prune_locked(now)
            for sequence_id in ids:
                self._items[sequence_id] = _Sequence(tenant, session_id, prompt_length, max_tokens, now)
                self._items.move_to_end(sequence_id)
            while len(self._items) > self.max_sequences:
                self._items.popitem(last=False)

    def sampled(self, ids: Sequence[str], lengths: Sequence[int]) -> None:
        """The token counts the samples ``ids`` came out with (a dropped id is skipped)."""
        with self._lock:
            for sequence_id, length in zip(ids, lengths, strict=True):
                seq = self._items.get(sequence_id)
                if seq is not None:
                    seq.sampled = length

    def _prune_locked(self, now: float) -> None:
        while self._items:
            oldest = next(iter(self._items.values()))
            if now - oldest.last_used <= self.retention_seconds:
                return
            self._items.popitem(last=False)

    def check(self, msg: pb.ForwardBackwardRequest, lengths: Sequence[int], *, tenant: str, session_id: str) -> None:
        """Check the provenance of every datum of ``msg`` (``lengths[i]``: datum i's input tokens,
        which both span lists tile) for a training request of ``tenant`` in ``session_id``; then
        restart the day of every sequence it names. ``WireError`` naming the first bad span."""
        now = self._clock()
        used: set[str] = set()
        with self._lock:
            for i, (datum, length) in enumerate(zip(msg.data, lengths, strict=True)):
                field = f"forward_backward_input.data[{i}]"
                has_inputs, has_rows = len(datum.model_input_spans) > 0, len(datum.loss_fn_input_spans) > 0
                if has_inputs != has_rows:
                    missing = "loss_fn_input_spans" if has_inputs else "model_input_spans"
                    raise WireError(
                        f"{field}.{missing}: missing; provenance comes as a pair (model_input_spans and "
                        "loss_fn_input_spans, Datum.with_provenance)"
                    )
                for name, spans in (
                    ("model_input_spans", datum.model_input_spans),
                    ("loss_fn_input_spans", datum.loss_fn_input_spans),
                ):
                    what = "model_input" if name == "model_input_spans" else "loss_fn_inputs.target_tokens"
                    covered = 0
                    for j, span in enumerate(spans):
                        used.add(self._check_span_locked(span, f"{field}.{name}[{j}]", tenant, session_id, now))
                        covered += self._arm(span, f"{field}.{name}[{j}]").length
                    if spans and covered != length:
                        raise WireError(
                            f"{field}.{name}: the runs cover {covered} positions but {what} has {length}; "
                            "they must tile it exactly"
                        )
            for sequence_id in used:
                self._items[sequence_id].last_used = now
                self._items.move_to_end(sequence_id)

    @staticmethod
    def _arm(span: pb.ProvenanceSpan, field: str) -> pb.PromptProvenanceSpan | pb.SampledProvenanceSpan:
        kind = span.WhichOneof("span")
        if kind is None:
            raise WireError(f"{field}: names neither prompt_tokens nor sampled_tokens")
        arm: pb.PromptProvenanceSpan | pb.SampledProvenanceSpan = getattr(span, kind)
        return arm

    def _check_span_locked(self, span: pb.ProvenanceSpan, field: str, tenant: str, session_id: str, now: float) -> str:
        """The sequence id of one span, every rule of the module docstring checked."""
        arm = self._arm(span, field)
        kind = span.WhichOneof("span")
        field = f"{field}.{kind}"
        if arm.offset < 0 or arm.length < 0:
            raise WireError(f"{field}: offset {arm.offset}, length {arm.length}; both must be >= 0")
        seq = self._items.get(arm.sequence_id)
        if seq is None or seq.tenant != tenant:
            raise WireError(
                f"{field}.sequence_id: unknown sequence {arm.sequence_id!r}; name a sequence_id a sampling "
                "request of the same client session returned (kept in memory, for a day after their last use)"
            )
        if seq.session_id != session_id:
            raise WireError(
                f"{field}.sequence_id: {arm.sequence_id!r} was sampled in another session; a training request "
                "can only name sequences sampled in its own session"
            )
        if now - seq.last_used > self.retention_seconds:
            raise WireError(
                f"{field}.sequence_id: {arm.sequence_id!r} expired: it was last sampled or trained on more than "
                f"{self.retention_seconds / 3600:g} hours ago"
            )
        bound, what = (
            (seq.prompt_length, "its prompt has") if kind == "prompt_tokens" else (seq.sampled, "its sample has")
        )
        if arm.offset + arm.length > bound:
            raise WireError(
                f"{field}: positions [{arm.offset}, {arm.offset + arm.length}) of {arm.sequence_id!r}, but {what} "
                f"{bound} tokens"
            )
        return str(arm.sequence_id)
