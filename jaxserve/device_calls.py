"""The messages between the processes of one engine, as a typed schema (msgspec), never pickle.

Process 0 sends each device call (a step's arrays, page copies, a pool reset) to the other
processes, which replay it. A follower first says `Hello` with a fingerprint of the engine it
built; the leader answers `Welcome` or `Refused`. Every message travels in a `Frame` with the
protocol version and its place in the sender's sequence; a frame of another version, out of
order, or that does not decode as one of these kinds is a `ProtocolError`, never acted on.
Arrays travel as dtype, shape and raw bytes, their dtype one of a fixed few; an array whose
elements are all one value (a step's unused token history, masks or biases: most of its bytes)
travels as that value alone. A step's arrays of 64 KiB or more travel as their changes to the
step's before them where that is fewer bytes (`StepArrays`): from one decode step to the next, a
block table changes once in a page's worth of tokens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import msgspec
import numpy as np

PROTOCOL_VERSION = 4   # 2: steps run to their logits, sampled by a later call (StepSample);
                       # 3: a step's arrays as changes to the step's before (StepArrays)
                       # 4: a step's sampling arrays name penalty slots (penalty_slots.py)
_DTYPES = frozenset(np.dtype(t).str for t in (np.bool_, np.int8, np.int32, np.uint32, np.int64, np.float32))
_FILL_MIN_BYTES = 1024   # smaller arrays travel as bytes: checking them costs more than it saves
_CHANGES_MIN_BYTES = 64 * 1024   # smaller ones are not compared with the step before's: for a 32 KiB
                                 # block table finding and applying its changes cost about what its
                                 # bytes took on a trip over loopback (tools/bench_channel.py)


class ProtocolError(RuntimeError):
    """A frame that is not the next valid message of this protocol version."""


class Array(msgspec.Struct, array_like=True, frozen=True):
    dtype: str                 # numpy's dtype.str, e.g. "<i4"
    shape: tuple[int, ...]
    data: memoryview           # no copy: the array's own buffer, and on decoding a view of the frame;
                               # empty when `fill` is set
    fill: bool | int | float | None = None   # every element's value, sent instead of the bytes
    changed: memoryview | None = None        # int32 flat indices of the elements that differ from the
                                             # array before (StepArrays); `data`: their new values

    @classmethod
    def of(cls, value, before: np.ndarray | None = None) -> "Array":
        """`value` as bytes, as its one value, or as its changes to `before` (an array the
        receiver has: see StepArrays), whichever is fewest bytes."""
        value = np.ascontiguousarray(value)
        flat = value.reshape(-1)
        if value.nbytes >= _FILL_MIN_BYTES:
            bits = np.dtype(f"u{value.itemsize}")   # compared bit for bit: -0.0 is not 0.0
            same = flat.view(bits)
            if same[0] == same[-1] and flat[0] == flat[0] and (same == same[0]).all():   # NaN: as bytes
                return cls(value.dtype.str, value.shape, memoryview(b""), flat[0].item())
            if (value.nbytes >= _CHANGES_MIN_BYTES and before is not None and before.shape == value.shape
                    and before.dtype == value.dtype):
                changed = np.flatnonzero(same != before.reshape(-1).view(bits)).astype(np.int32)
                if changed.size * (changed.itemsize + value.itemsize) <= value.nbytes // 2:
                    return cls(value.dtype.str, value.shape, memoryview(flat[changed].view(np.uint8)),
                               changed=memoryview(changed.view(np.uint8)))
        return cls(value.dtype.str, value.shape, memoryview(flat.view(np.uint8)))

    def value(self, before: np.ndarray | None = None) -> np.ndarray:
        """The array; `before`: the one its changes apply to, when it was sent as changes."""
        if self.dtype not in _DTYPES:
            raise ProtocolError(f"array dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        dtype = np.dtype(self.dtype)
        if self.changed is not None:
            return self._changed(dtype, before)
        if self.fill is not None:
            if any(n < 0 for n in self.shape) or len(self.data) or not _holds(dtype, self.fill):
                raise ProtocolError(f"a {self.dtype} array of shape {self.shape} filled with {self.fill!r} "
                                    f"and {len(self.data)} bytes")
            return _full(tuple(self.shape), np.array(self.fill, dtype).tobytes(), dtype)
        if any(n < 0 for n in self.shape) or math.prod(self.shape) * dtype.itemsize != len(self.data):
            raise ProtocolError(f"{len(self.data)} bytes do not make a {self.dtype} array of shape {self.shape}")
        return np.frombuffer(self.data, dtype).reshape(self.shape)

    def _changed(self, dtype: np.dtype, before: np.ndarray | None) -> np.ndarray:
        shape = tuple(self.shape)
        if before is None or before.shape != shape or before.dtype != dtype:
            had = "no array" if before is None else f"a {before.dtype.str} array of shape {before.shape}"
            raise ProtocolError(f"changes to a {self.dtype} array of shape {shape}, where the step before had {had}")
        if self.fill is not None or len(self.changed) % 4 or len(self.data) != len(self.changed) // 4 * dtype.itemsize:
            raise ProtocolError(f"{len(self.changed)} bytes of indices and {len(self.data)} bytes of "
                                f"{self.dtype} values{' and a fill' if self.fill is not None else ''} "
                                f"do not make changes to an array")
        indices = np.frombuffer(self.changed, np.int32)
        if indices.size and (indices.min() < 0 or indices.max() >= before.size):
            raise ProtocolError(f"changes at indices {indices.min()}..{indices.max()} of an array of "
                                f"{before.size} elements")
        value = before.copy()
        value.reshape(-1)[indices] = np.frombuffer(self.data, dtype)
        return value


class StepArrays:
    """A step's arrays as changes to the step's before them, where that is fewer bytes (`Array.of`).
    The sender and every receiver keep the last step's arrays: frames arrive whole and in order
    (`Inbox`), each receiver reads every step, and a sender never writes to an array it sent."""

    def __init__(self):
        self._before: list[np.ndarray] = []

    def _befores(self, count: int) -> list[np.ndarray | None]:
        return self._before if len(self._before) == count else [None] * count

    def send(self, values: Sequence[np.ndarray]) -> tuple[Array, ...]:
        values = list(map(np.ascontiguousarray, values))
        arrays = tuple(map(Array.of, values, self._befores(len(values))))
        self._before = values
        return arrays

    def receive(self, arrays: Sequence[Array]) -> list[np.ndarray]:
        values = list(map(Array.value, arrays, self._befores(len(arrays))))
        self._before = values
        return values


@functools.lru_cache(maxsize=64)
def _full(shape: tuple[int, ...], value: bytes, dtype: np.dtype) -> np.ndarray:
    """A read-only array of one value (its bytes: -0.0 is not 0.0), shared: a follower gets the
    same few every step (read-only as the arrays viewing a frame are)."""
    array = np.full(shape, np.frombuffer(value, dtype)[0], dtype)
    array.setflags(write=False)
    return array


def _holds(dtype: np.dtype, value) -> bool:
    """Whether `dtype` holds `value` exactly."""
    try:
        return bool(np.array(value).astype(dtype) == value)
    except (OverflowError, TypeError, ValueError):
        return False


class Step(msgspec.Struct, tag="step", frozen=True):
    num_decode: int            # the step's bucket
    num_segments: int
    leaves: tuple[Array, ...]  # the StepInput's arrays in pytree order
    decode_len: int = 1
    model: int = 0             # whose runner: 0 the target's, 1 the speculative draft model's
    to_logits: bool = False    # run to its logits only: the allowed-token masks come with StepSample


class StepSample(msgspec.Struct, tag="sample", frozen=True):
    """Samples the step run `to_logits` before it, with these allowed-token masks."""
    allowed: Array             # the step's sampling rows' packed masks ([S, ceil(vocab / 32)])
    model: int = 0


class CompileSplit(msgspec.Struct, tag="compile_split", frozen=True):
    """Compile this bucket's two programs (to the logits, then the sampling) in the background:
    the leader's own compile of them has begun, and its first such step follows once it ends."""
    num_decode: int
    num_segments: int
    decode_len: int = 1
    model: int = 0


class CopyPages(msgspec.Struct, tag="copy", frozen=True):
    source: Array
    destination: Array
    model: int = 0


class ResetPool(msgspec.Struct, tag="reset", frozen=True):
    model: int = 0


class LoadLora(msgspec.Struct, tag="lora", frozen=True):
    slot: int                   # the LoRA slot overwritten
    leaves: tuple[Array, ...]   # each module's A then B, in the runner's module order


class Stop(msgspec.Struct, tag="stop", frozen=True):
    pass


class Hello(msgspec.Struct, tag="hello", frozen=True):
    process_id: int
    fingerprint: dict[str, str]


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    pass


class Refused(msgspec.Struct, tag="refused", frozen=True):
    reason: str


DeviceCall = Step | StepSample | CompileSplit | CopyPages | ResetPool | LoadLora | Stop
Message = Step | StepSample | CompileSplit | CopyPages | ResetPool | LoadLora | Stop | Hello | Welcome | Refused


class Frame(msgspec.Struct, array_like=True, frozen=True):
    version: int
    sequence: int
    message: Message


class Outbox:
    """Frames one sender's messages, numbered from 0."""

    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder()
        self._sequence = 0

    def frame(self, message: Message) -> bytes:
        data = self._encoder.encode(Frame(PROTOCOL_VERSION, self._sequence, message))
        self._sequence += 1
        return data


class Inbox:
    """Reads one sender's frames: each must be this version's, and the next in its sequence."""

    def __init__(self):
        self._decoder = msgspec.msgpack.Decoder(Frame)
        self._version = msgspec.msgpack.Decoder(tuple)
        self._expected = 0

    def read(self, data: bytes) -> Message:
        try:
            frame = self._decoder.decode(data)
        except msgspec.DecodeError as error:   # ValidationError is one: an unknown kind, a wrong field
            raise ProtocolError(f"{self._versioned(data)}a frame that is not a valid message: {error}") from None
        if frame.version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {frame.version}, but this process speaks {PROTOCOL_VERSION}")
        if frame.sequence != self._expected:
            raise ProtocolError(f"frame {frame.sequence} where frame {self._expected} was due: replayed, lost "
                                f"or reordered")
        self._expected += 1
        return frame.message

    def _versioned(self, data: bytes) -> str:
        # A frame of another version may not decode as this version's Frame: say which it was.
        try:
            version = self._version.decode(data)[0]
        except (msgspec.DecodeError, IndexError, TypeError):
            return ""
        return f"protocol version {version}: " if version != PROTOCOL_VERSION else ""


def differences(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The fields in which two fingerprints differ, each as 'name: mine != theirs'."""
    names = sorted(set(mine) | set(theirs))
    return [f"{name}: {mine.get(name)} != {theirs.get(name)}" for name in names if mine.get(name) != theirs.get(name)]
