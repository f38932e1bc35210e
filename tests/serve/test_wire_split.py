"""``forward_backward`` read datum by datum: the same message as one parse, and limits on the way."""

from __future__ import annotations

import numpy as np
import pytest
from tinker.proto import tinker_public_pb2 as pb

from harts.serve.wire import WireError, batch_tokens, decode_forward_backward, parse_datums, split_forward_backward


def datum(tokens: list[int]) -> pb.Datum:
    d = pb.Datum()
    d.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
    target = d.loss_fn_inputs["target_tokens"]
    target.dense, target.dtype = np.asarray(tokens[1:] + [0], np.int64).tobytes(), pb.DTYPE_INT64
    return d


def request(n: int) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest(model_id="s:train:0", seq_id=3, loss_fn="ppo", forward_only=True)
    msg.loss_fn_config["clip_low_threshold"] = 0.8
    msg.loss_fn_config_v2["mode"].text = "x"
    for i in range(n):
        msg.data.append(datum(list(range(1, i + 3))))
    return msg


def split(body: bytes, max_datums: int = 100, max_tokens: int = 64) -> pb.ForwardBackwardRequest:
    msg, datums = split_forward_backward(body, None, max_bytes=1 << 30, max_datums=max_datums)
    parse_datums(msg, datums, max_datums=max_datums, max_tokens=max_tokens)
    return msg


def test_split_reads_the_message_one_parse_reads_in_any_field_order():
    body = request(5).SerializeToString()
    assert split(body) == decode_forward_backward(body, None, max_bytes=1 << 30)
    # the SDK writes fields in number order; any order (datums between other fields) reads the same
    head = pb.ForwardBackwardRequest(model_id="s:train:0", seq_id=3).SerializeToString()
    tail = pb.ForwardBackwardRequest(loss_fn="ppo", forward_only=True).SerializeToString()
    data = pb.ForwardBackwardRequest(data=[datum([1, 2]), datum([3, 4, 5])]).SerializeToString()
    assert split(tail + data + head) == decode_forward_backward(tail + data + head, None, max_bytes=1 << 30)
    assert batch_tokens(split(body)) == sum(i + 3 for i in range(5))


def test_too_many_datums_are_refused_after_reading_one_more_than_the_limit():
    body = request(10).SerializeToString()
    msg, datums = split_forward_backward(body, None, max_bytes=1 << 30, max_datums=4)
    assert len(datums) == 5 and msg.model_id == "s:train:0" and msg.seq_id == 3  # known, to free its number
    with pytest.raises(WireError, match=r"forward_backward_input\.data: more than 4 datums.*--max-datums"):
        parse_datums(msg, datums, max_datums=4, max_tokens=64)


def test_a_datum_larger_than_capacity_allows_and_broken_bodies_are_refused():
    big = pb.ForwardBackwardRequest(data=[datum(list(range(1, 10_000)))]).SerializeToString()
    with pytest.raises(WireError, match=r"data\[0\]: \d+ bytes; a datum of at most 16 tokens \(--capacity\)"):
        split(big, max_tokens=16)
    body = request(3).SerializeToString()
    for broken in (body[:-3], body + b"\x0b", b"\xff" * 12):
        with pytest.raises(WireError, match="not a tinker ForwardBackwardRequest protobuf"):
            split(broken)
