"""The typed frames between processes: what decodes, and what is refused."""

import msgspec
import numpy as np
import pytest

from jaxserve.device_calls import (
    PROTOCOL_VERSION, Array, CompileSplit, CopyPages, Hello, Inbox, Outbox, ProtocolError, ResetPool, Step, StepArrays,
    StepSample, Stop, differences)


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
    negative_zero = np.zeros(1024, np.float32)
    negative_zero[3] = -0.0
    for array in negative_zero, np.full(1024, np.nan, np.float32):   # bit for bit, not as ==
        got = Array.of(array)
        assert got.fill is None and got.value().tobytes() == array.tobytes()


def _decode_steps(num_steps: int, rows: int = 64, width: int = 512, history: int = 2048):
    """The arrays of `num_steps` decode steps in a row: one token a row a step, a page added to a
    row's table once in 16 tokens, a penalised history grown by the token, seeds and a float row."""
    rng = np.random.default_rng(0)
    tables, histories = np.zeros((rows, width), np.int32), np.full((rows, history), 49152, np.int32)
    lengths = rng.integers(20, 200, rows)
    for length, table, row in zip(lengths, tables, histories):
        table[:-(-length // 16)] = rng.integers(1, 5000, -(-length // 16))
        row[:length] = rng.integers(0, 49152, length)
    for step in range(num_steps):
        tables, histories = tables.copy(), histories.copy()
        positions = (lengths + step).astype(np.int32)
        starts_page = np.flatnonzero(positions % 16 == 0)
        tables[starts_page, positions[starts_page] // 16] = rng.integers(1, 5000, starts_page.size)
        histories[np.arange(rows), positions - 1] = rng.integers(0, 49152, rows)
        floats = np.zeros(16384, np.float32)
        floats[step] = -0.0 if step % 2 else np.nan   # bit for bit: -0.0 is not 0.0
        small = np.arange(4096, dtype=np.int32)   # 16 KiB: always whole, unchanged or not
        yield [positions, tables, histories, rng.integers(0, 2**32, rows, dtype=np.uint32), floats, small]


def test_a_step_travels_as_its_changes_to_the_step_before():
    outbox, inbox, sender, receiver = Outbox(), Inbox(), StepArrays(), StepArrays()
    sizes, kinds = [], []
    for values in _decode_steps(20):
        frame = outbox.frame(Step(64, 0, sender.send(values)))
        arrays = inbox.read(frame).leaves
        received = receiver.receive(arrays)
        for sent, got in zip(values, received):
            assert got.dtype == sent.dtype and got.shape == sent.shape
            assert got.tobytes() == sent.tobytes()
        sizes.append(len(frame))
        kinds.append(["changes" if a.changed is not None else "fill" if a.fill is not None else "bytes" for a in arrays])
    # positions and seeds (256 bytes each) and the 16 KiB array always whole; tables, histories and
    # the float row (a NaN, then a -0.0 among zeros) as their changes after the first step
    assert kinds[0] == ["bytes"] * 6
    assert all(k == ["bytes", "changes", "changes", "bytes", "changes", "bytes"] for k in kinds[1:])
    assert sizes[0] > 64 * 2048 * 4 and max(sizes[1:]) < 4096 * 4 + 2_000


def test_a_step_of_other_shapes_travels_whole_and_the_next_as_changes_to_it():
    sender, receiver = StepArrays(), StepArrays()
    first, second = np.arange(16384, dtype=np.int32), np.arange(32768, dtype=np.int32)
    third = second.copy()
    third[5] = -1
    receiver.receive(sender.send([first]))
    unchanged, = sender.send([first])   # the same array again: no changes, no bytes
    assert unchanged.changed is not None and len(unchanged.data) == len(unchanged.changed) == 0
    np.testing.assert_array_equal(receiver.receive([unchanged])[0], first)
    whole, = sender.send([second])
    assert whole.changed is None and len(whole.data) == second.nbytes
    changes, = sender.send([third])
    receiver.receive([whole])
    assert len(changes.data) == 4 and changes.changed is not None
    np.testing.assert_array_equal(receiver.receive([changes])[0], third)


@pytest.mark.parametrize("before, array, message", [
    (None, Array("<i4", (4,), b"\0" * 4, changed=b"\0" * 4), r"changes to a <i4 array of shape \(4,\), where the "
     r"step before had no array"),
    (np.zeros(5, np.int32), Array("<i4", (4,), b"\0" * 4, changed=b"\0" * 4), r"had a <i4 array of shape \(5,\)"),
    (np.zeros(4, np.float32), Array("<i4", (4,), b"\0" * 4, changed=b"\0" * 4), "had a <f4 array"),
    (np.zeros(4, np.int32), Array("<i4", (4,), b"\0" * 8, changed=b"\0" * 4), "4 bytes of indices and 8 bytes"),
    (np.zeros(4, np.int32), Array("<i4", (4,), b"\0" * 4, changed=b"\0" * 3), "3 bytes of indices"),
    (np.zeros(4, np.int32), Array("<i4", (4,), b"", 1, changed=b""), "and a fill"),
    (np.zeros(4, np.int32), Array("<i4", (4,), b"\0" * 4, changed=np.array([4], np.int32).tobytes()),
     r"changes at indices 4..4 of an array of 4 elements"),
    (np.zeros(4, np.int32), Array("<i4", (4,), b"\0" * 4, changed=np.array([-1], np.int32).tobytes()),
     "at indices -1..-1"),
])
def test_changes_that_do_not_fit_the_array_before_are_refused(before, array, message):
    with pytest.raises(ProtocolError, match=message):
        array.value(before)


def test_differences_name_each_field():
    assert differences({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}) == ["b: 2 != 3", "c: None != 4"]
