"""What a KV transfer puts on the wire: the spec as msgpack, control frames' bytes (a fixed head,
a tail when longer), and the named frame types, which encode to the dicts the receiver reads."""

from __future__ import annotations

from array import array

import msgpack
import pytest
import torch

from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.frames import EndFrame, Hello, LayersFrame, ReadyFrame, parse_frame
from tandem.kv_transfer.link import (FRAME_BYTES, MAX_FRAME_BYTES, decode_frame, encode_frame, frame_bytes,
                                     frame_tail_bytes)

from tests.unit.kv_factories import make_spec


def test_spec_msgpack_round_trip_and_validation():
    spec = make_spec()
    assert TransferSpec.from_msg(msgpack.unpackb(msgpack.packb(spec.to_msg()))) == spec
    with pytest.raises(ValueError):
        make_spec(src=(1, 2), dst=(3,))
    with pytest.raises(ValueError):
        make_spec(layers=(0, 0))
    with pytest.raises(ValueError):
        make_spec(dst=(4, 4, 5))
    with pytest.raises(ValueError):
        TransferSpec("r", "a", "a", (0,), (1,), (1,), 1)


def test_control_frame_round_trip():
    msg = {"op": "layer", "rid": "r" * 200, "idx": 3, "layer": 7, "shape": [3, 2, 4, 2, 8]}
    frame = encode_frame(msg)
    assert frame.shape == (FRAME_BYTES,) and frame.dtype == torch.uint8
    assert decode_frame(frame) == msg and frame_tail_bytes(frame) == 0
    # a longer frame (a direct copy's block ids) is a head and a tail, decoded as one
    big = {"op": "ready", "src": bytes(range(256)) * 40}
    frame = encode_frame(big)
    assert frame.numel() > FRAME_BYTES and frame_tail_bytes(frame[:FRAME_BYTES]) == frame.numel() - FRAME_BYTES
    assert decode_frame(frame) == big
    with pytest.raises(ValueError, match="corrupt"):
        decode_frame(frame[:FRAME_BYTES])          # the head alone
    with pytest.raises(ValueError, match="exceeds"):
        encode_frame({"op": "x", "blob": "y" * MAX_FRAME_BYTES})
    # the Unix socket carries the same frames as bytes
    raw = frame_bytes(big)
    assert bytes(raw) == encode_frame(big).numpy().tobytes()
    assert frame_tail_bytes(raw[:FRAME_BYTES]) == len(raw) - FRAME_BYTES and decode_frame(raw) == big


def test_named_frames_encode_to_the_wire_dicts_and_parse_back():
    frames = [Hello(b"cache", b"acks", None, 3, "boot-id"),
              LayersFrame("r1", 2, [2, 3, 4], [2, 1], [2, 3, 4, 2, 8], "bfloat16"),
              ReadyFrame("r1", 0, [0, 1], 7, src=array("i", [5, 9, 1]).tobytes()),
              ReadyFrame("r1", 2, [2], 8, ids_at=128, n=3),
              ReadyFrame("r1", 3, [3], 9),
              EndFrame("r1", "aborted", "aborted by the sender")]
    for frame in frames:
        msg = frame.to_msg()
        assert decode_frame(frame_bytes(msg)) == msg
        assert parse_frame(decode_frame(frame_bytes(msg))) == frame
    assert frames[1].to_msg() == {"op": "layers", "rid": "r1", "idx": 2, "layers": [2, 3, 4], "parts": [2, 1],
                                  "shape": [2, 3, 4, 2, 8], "dtype": "bfloat16"}
    assert "src" not in frames[3].to_msg() and "ids_at" not in frames[4].to_msg()
    # a layers frame without parts is one message; an end frame without a reason says who ended it
    assert parse_frame({"op": "layers", "rid": "r", "idx": 0, "layers": [0, 1], "shape": [1],
                        "dtype": "float32"}).parts == [2]
    assert parse_frame({"op": "end", "rid": "r"}).reason == "ended by the sender"
    # a hello with odd fields still parses (the receiver then declines the offer); unknown ops
    # come back as the dict, for the receiver to refuse
    assert parse_frame({"op": "hello", "cache": b"x"}) == Hello(b"x", None, None, None, None)
    assert parse_frame({"op": "nope", "rid": "r"}) == {"op": "nope", "rid": "r"}
