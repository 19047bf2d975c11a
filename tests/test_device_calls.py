"""The typed frames between processes: what decodes, and what is refused."""

import msgspec
import numpy as np
import pytest

from jaxserve.device_calls import (
    PROTOCOL_VERSION, Array, CompileSplit, CopyPages, Hello, Inbox, Outbox, ProtocolError, ResetPool, Step, StepSample,
    Stop, differences)


def test_frames_round_trip_in_order():
    leaves = (Array.of(np.arange(100_000, dtype=np.int32)), Array.of(np.ones((3, 4), np.float32)),
              Array.of(np.array([True, False])), Array.of(np.zeros((2, 0), np.uint32)))
    messages = [Hello(1, {"config.seed": "0"}), CopyPages(Array.of(np.array([1, 2], np.int32)),
                                                          Array.of(np.array([3, 4], np.int32))),
                Step(4, 1, leaves), ResetPool(), CompileSplit(2, 0), Step(2, 0, leaves[:1], to_logits=True),
                StepSample(Array.of(np.full((2, 3), -1, np.int32))), Stop()]
    outbox, inbox = Outbox(), Inbox()
    received = [inbox.read(outbox.frame(m)) for m in messages]
    assert received == messages
    step = received[2]
    for sent, got in zip(leaves, step.leaves):
        np.testing.assert_array_equal(sent.value(), got.value())
        assert sent.value().dtype == got.value().dtype


def test_a_replayed_or_skipped_frame_is_refused():
    outbox, inbox = Outbox(), Inbox()
    first, second, third = (outbox.frame(ResetPool()) for _ in range(3))
    inbox.read(first)
    with pytest.raises(ProtocolError, match="frame 0 where frame 1 was due: replayed"):
        inbox.read(first)
    with pytest.raises(ProtocolError, match="frame 2 where frame 1 was due"):
        inbox.read(third)
    assert inbox.read(second) == ResetPool()


def test_a_tampered_frame_is_refused():
    data = bytearray(Outbox().frame(Step(1, 0, (Array.of(np.arange(4, dtype=np.int32)),))))
    data[data.index(b"step") + 1] ^= 0x20   # the kind's tag: "stEp"
    with pytest.raises(ProtocolError, match="not a valid message"):
        Inbox().read(bytes(data))
    with pytest.raises(ProtocolError, match="not a valid message"):
        Inbox().read(b"\x93\x01\x00")   # a truncated frame
    with pytest.raises(ProtocolError, match="not a valid message"):
        Inbox().read(b"\x80 not msgpack")


def test_unknown_kinds_and_versions_are_errors_never_run():
    unknown = msgspec.msgpack.encode([PROTOCOL_VERSION, 0, {"type": "exec", "code": "rm -rf /"}])
    with pytest.raises(ProtocolError, match="not a valid message"):
        Inbox().read(unknown)
    other_version = msgspec.msgpack.encode([PROTOCOL_VERSION + 1, 0, {"type": "stop"}])
    with pytest.raises(ProtocolError, match=f"protocol version {PROTOCOL_VERSION + 1}, but this process speaks"):
        Inbox().read(other_version)
    future_shape = msgspec.msgpack.encode([PROTOCOL_VERSION + 1, 0, {"type": "a kind of version 2"}])
    with pytest.raises(ProtocolError, match=f"protocol version {PROTOCOL_VERSION + 1}: a frame"):
        Inbox().read(future_shape)


@pytest.mark.parametrize("array, message", [
    (Array("|O", (1,), b"\0" * 8), "dtype '|O' is not one of"),
    (Array("<i4", (3,), b"\0" * 8), "8 bytes do not make a <i4 array of shape (3,)"),
    (Array("<i4", (-1, -2), b"\0" * 8), "do not make"),
    (Array("<i4", (3,), b"", 2 ** 40), "a <i4 array of shape (3,) filled with 1099511627776 and 0 bytes"),
    (Array("<i4", (3,), b"", 0.5), "filled with 0.5"),
    (Array("<i4", (3,), b"\0" * 4, 1), "filled with 1 and 4 bytes"),
])
def test_arrays_of_a_wrong_kind_or_size_are_refused(array, message):
    with pytest.raises(ProtocolError, match=message.replace("(", r"\(").replace(")", r"\)")):
        array.value()


def test_an_array_of_one_value_travels_as_that_value():
    """A step's unused history, masks and biases are one value throughout: only it is sent."""
    arrays = [np.full((256, 2048), 49152, np.int32), np.full((64, 1536), -1, np.int32),
              np.full((64, 16), -np.inf, np.float32), np.ones(4096, np.bool_), np.full(512, 2 ** 32 - 1, np.uint32)]
    varied = np.arange(1024, dtype=np.int32)
    varied_ends = np.zeros(1024, np.int32)
    varied_ends[500] = 7   # first and last alike, the middle not
    small = np.zeros(8, np.int32)
    frame = Outbox().frame(Step(1, 0, tuple(map(Array.of, [*arrays, varied, varied_ends, small]))))
    assert len(frame) < 2 * 4096 + 32 + 400   # the bytes of the last three only (the others: 2.3 MB)
    received = Inbox().read(frame).leaves
    for sent, got in zip([*arrays, varied, varied_ends, small], received):
        value = got.value()
        assert value.dtype == sent.dtype and value.shape == sent.shape
        np.testing.assert_array_equal(value, sent)
    assert [got.fill is not None for got in received] == [True] * len(arrays) + [False, False, False]


def test_differences_name_each_field():
    assert differences({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}) == ["b: 2 != 3", "c: None != 4"]
