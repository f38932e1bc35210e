"""``SequenceLog``: a datum's provenance checked against the sequences this server sampled, on
the SDK's protobuf messages, with a clock the test moves (Tinker's rules: own session only, one
day after the last use, runs tiling their field)."""

from __future__ import annotations

import pytest

pb = pytest.importorskip("tinker.proto.tinker_public_pb2")

from harts.serve.provenance import RETENTION_SECONDS, SequenceLog  # noqa: E402
from harts.serve.wire import WireError  # noqa: E402

PROMPT, MAX_TOKENS = 5, 8


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def span(kind: str, sequence_id: str, offset: int, length: int) -> pb.ProvenanceSpan:
    out = pb.ProvenanceSpan()
    getattr(out, kind).CopyFrom(
        (pb.PromptProvenanceSpan if kind == "prompt_tokens" else pb.SampledProvenanceSpan)(
            sequence_id=sequence_id, offset=offset, length=length
        )
    )
    return out


def request(*datums: tuple[list[pb.ProvenanceSpan], list[pb.ProvenanceSpan]]) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest()
    for inputs, rows in datums:
        d = msg.data.add()
        d.model_input_spans.extend(inputs)
        d.loss_fn_input_spans.extend(rows)
    return msg


def rl_datum(sequence_id: str, sampled: int = 3) -> tuple[list[pb.ProvenanceSpan], list[pb.ProvenanceSpan]]:
    """A prompt of PROMPT tokens and ``sampled`` sampled ones: the input is prompt + sampled[:-1],
    the rows predict prompt[1:] + sampled (length PROMPT + sampled - 1 both)."""
    inputs = [span("prompt_tokens", sequence_id, 0, PROMPT), span("sampled_tokens", sequence_id, 0, sampled - 1)]
    rows = [span("prompt_tokens", sequence_id, 1, PROMPT - 1), span("sampled_tokens", sequence_id, 0, sampled)]
    return inputs, rows


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def log(clock: Clock) -> SequenceLog:
    out = SequenceLog(clock=clock)
    out.record(["r1:0", "r1:1"], tenant="a", session_id="s1", prompt_length=PROMPT, max_tokens=MAX_TOKENS)
    return out


def refused(log: SequenceLog, msg: pb.ForwardBackwardRequest, lengths: list[int], *needles: str, **who: str) -> None:
    with pytest.raises(WireError) as excinfo:
        log.check(msg, lengths, **({"tenant": "a", "session_id": "s1"} | who))
    text = str(excinfo.value)
    assert excinfo.value.status == 400 and "\n" not in text, text
    for needle in needles:
        assert needle in text, text


def test_own_sequences_pass_and_datums_without_provenance_are_not_checked(log: SequenceLog) -> None:
    length = PROMPT + 3 - 1
    log.check(request(rl_datum("r1:0"), ([], []), rl_datum("r1:1")), [length, 4, length], tenant="a", session_id="s1")


def test_unknown_foreign_and_other_session_sequences_are_refused_naming_the_span(log: SequenceLog) -> None:
    length = PROMPT + 2
    inputs, rows = rl_datum("r1:0")
    bad_rows = [rows[0], span("sampled_tokens", "nope:0", 0, 3)]
    needle = "data[1].loss_fn_input_spans[1].sampled_tokens.sequence_id"
    refused(log, request(rl_datum("r1:1"), (inputs, bad_rows)), [length, length], needle, "unknown sequence 'nope:0'")
    # another tenant's sequence reads as unknown (its existence is not told)
    refused(log, request(rl_datum("r1:0")), [length], "data[0].model_input_spans[0]", "unknown", tenant="b")
    refused(log, request(rl_datum("r1:0")), [length], "model_input_spans[0]", "another session", session_id="s2")


def test_a_sequence_expires_a_day_after_its_last_use_and_each_use_restarts_the_day(
    log: SequenceLog, clock: Clock
) -> None:
    length = PROMPT + 2
    clock.t += RETENTION_SECONDS - 1
    log.check(request(rl_datum("r1:0")), [length], tenant="a", session_id="s1")  # restarts r1:0's day
    clock.t += 2
    refused(log, request(rl_datum("r1:1")), [length], "data[0].model_input_spans[0]", "expired")
    log.check(request(rl_datum("r1:0")), [length], tenant="a", session_id="s1")
    # a refused request restarts nothing: r1:0 is named beside the expired r1:1
    clock.t += RETENTION_SECONDS - 1
    refused(log, request(rl_datum("r1:0"), rl_datum("r1:1")), [length, length], "data[1]", "expired")
    clock.t += 2
    refused(log, request(rl_datum("r1:0")), [length], "expired")
    # recording prunes what expired
    log.record(["r2:0"], tenant="a", session_id="s1", prompt_length=PROMPT, max_tokens=MAX_TOKENS)
    assert len(log) == 1


def test_runs_must_tile_their_field_and_stay_inside_the_sequence(log: SequenceLog) -> None:
    length = PROMPT + 2
    inputs, rows = rl_datum("r1:0")
    refused(log, request((inputs, rows)), [length + 1], "data[0].model_input_spans: the runs cover 7", "has 8")
    refused(log, request((inputs, rows[:1])), [length], "data[0].loss_fn_input_spans: the runs cover 4")
    refused(log, request((inputs, [])), [length], "data[0].loss_fn_input_spans: missing", "pair")
    over = [span("prompt_tokens", "r1:0", 1, PROMPT), span("sampled_tokens", "r1:0", 0, 2)]
    refused(log, request((over, rows)), [PROMPT + 3], "model_input_spans[0].prompt_tokens: positions [1, 6)", "5")
    long = [span("prompt_tokens", "r1:0", 0, 1), span("sampled_tokens", "r1:0", 0, MAX_TOKENS + 1)]
    refused(
        log, request((long, long)), [MAX_TOKENS + 2], "model_input_spans[1].sampled_tokens", "its sample has 8 tokens"
    )
    neither = [pb.ProvenanceSpan()]
    refused(log, request((neither, rows)), [length], "model_input_spans[0]: names neither")
    negative = [span("prompt_tokens", "r1:0", -1, 2)]
    refused(log, request((negative, rows)), [length], "model_input_spans[0].prompt_tokens: offset -1")


def test_a_finished_sample_bounds_its_runs_by_the_tokens_it_came_out_with(log: SequenceLog) -> None:
    log.sampled(["r1:0", "r1:1"], [3, 1])
    log.check(request(rl_datum("r1:0", sampled=3)), [PROMPT + 2], tenant="a", session_id="s1")
    refused(
        log,
        request(rl_datum("r1:1", sampled=3)),
        [PROMPT + 2],
        "model_input_spans[1].sampled_tokens: positions [0, 2)",
        "has 1 tokens",
    )
    log.sampled(["gone:0"], [2])  # an id the log no longer holds is skipped
    assert len(log) == 2


def test_the_log_keeps_the_most_recently_used(clock: Clock) -> None:
    log = SequenceLog(clock=clock, max_sequences=2)
    for r in ("r1", "r2"):
        log.record([f"{r}:0"], tenant="a", session_id="s1", prompt_length=PROMPT, max_tokens=MAX_TOKENS)
    log.check(request(rl_datum("r1:0")), [PROMPT + 2], tenant="a", session_id="s1")  # r1:0 used last
    log.record(["r3:0"], tenant="a", session_id="s1", prompt_length=PROMPT, max_tokens=MAX_TOKENS)
    log.check(request(rl_datum("r1:0"), rl_datum("r3:0")), [PROMPT + 2] * 2, tenant="a", session_id="s1")
    refused(log, request(rl_datum("r2:0")), [PROMPT + 2], "unknown sequence 'r2:0'")
