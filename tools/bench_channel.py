"""What the channel between processes costs per step: a step's arrays sent whole against sent as
their changes to the step before (`device_calls.StepArrays`), framed and read back, and a
leader-to-follower trip over loopback, with CURVE and without.

    python tools/bench_channel.py [--steps 300]

Each bucket is run as consecutive decode steps of the default SmolLM2 layout: every decode row
holds a sequence one token further each step (a page added to its table once in 16), sampling at
temperature 0.7; the rows marked "penalised" also have a frequency penalty, so their [rows,
max_model_len] token history grows by a token a step. Unused histories, masks and biases are one
value throughout and travel as that value alone either way. Framing includes making the message
from the step's arrays and the follower's arrays from it (for changes: a copy of the step before's
array with them applied).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve import distributed  # noqa: E402
from jaxserve.device_calls import Array, Inbox, Outbox, Step, StepArrays  # noqa: E402
from jaxserve.engine.batch import BatchLayout, Bucket  # noqa: E402
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402

CASES = ((Bucket(1, 0), False), (Bucket(16, 0), False), (Bucket(64, 0), False), (Bucket(64, 4), False),
         (Bucket(64, 0), True), (Bucket(256, 0), True))   # (bucket, penalised)


def _name(bucket: Bucket, penalised: bool) -> str:
    return f"{bucket.num_decode}x{bucket.num_segments}{' penalised' if penalised else ''}"


def _steps(layout: BatchLayout, bucket: Bucket, penalised: bool, num_steps: int) -> list[list[np.ndarray]]:
    """The arrays of `num_steps` consecutive decode steps of `bucket`."""
    params = SamplingParams(temperature=0.7, frequency_penalty=0.5 if penalised else 0.0)
    rng = np.random.default_rng(0)
    rows = bucket.num_decode
    pages = rng.permutation(100_000)[:rows * layout.table_width].reshape(rows, -1).astype(np.int32)
    tokens = rng.integers(0, layout.vocab_size, (rows, 100 + rows + num_steps), dtype=np.int32)
    steps = []
    for step in range(num_steps):
        decodes = []
        for i in range(rows):
            position = 100 + i + step
            sequence = ScheduledSequence(str(i), (int(tokens[i, position]),), position,
                                         pages[i, :position // layout.page_size + 1], True, params, i, 3 + step)
            if penalised:
                sequence.history, sequence.num_prompt_tokens = tokens[i, :position], 100
            decodes.append(sequence)
        batch, _ = layout.build(SchedulerOutput(tuple(decodes)), bucket)
        steps.append(jax.tree.leaves(batch))
    return steps


def _message(sender: StepArrays, leaves: list[np.ndarray], bucket: Bucket, changes: bool) -> Step:
    return Step(bucket.num_decode, bucket.num_segments,
                sender.send(leaves) if changes else tuple(map(Array.of, leaves)))


def _reader(changes: bool):
    """The follower's side: a step's arrays from its message."""
    receiver = StepArrays()
    return (lambda step: receiver.receive(step.leaves)) if changes else (lambda step: [a.value() for a in step.leaves])


def _median_us(times: list[float]) -> float:
    return statistics.median(times) * 1e6


def framing(steps_of: dict) -> None:
    """Per step: the leader's making of the frame from the step's arrays, the follower's reading
    of the arrays from it (the trip between them not counted)."""
    print("| step | whole KiB | changes KiB | leader whole us | leader changes us | follower whole us | "
          "follower changes us |\n|---|---|---|---|---|---|---|")
    for (bucket, penalised), steps in steps_of.items():
        sizes, made, read = {}, {}, {}
        for changes in (False, True):
            outbox, inbox, sender, reader = Outbox(), Inbox(), StepArrays(), _reader(changes)
            sizes[changes], made[changes], read[changes] = [], [], []
            for leaves in steps:
                started = time.perf_counter()
                frame = outbox.frame(_message(sender, leaves, bucket, changes))
                framed = time.perf_counter()
                reader(inbox.read(frame))
                read[changes].append(time.perf_counter() - framed)
                made[changes].append(framed - started)
                sizes[changes].append(len(frame))
        print(f"| {_name(bucket, penalised)} | {statistics.median(sizes[False]) / 1024:.1f} | "
              f"{statistics.median(sizes[True]) / 1024:.1f} | {_median_us(made[False]):.0f} | "
              f"{_median_us(made[True]):.0f} | {_median_us(read[False]):.0f} | {_median_us(read[True]):.0f} |")


def trip(steps_of: dict, keys_dir: str | None, changes: bool) -> dict:
    """Median send-to-read microseconds per step kind, one follower thread over loopback; the
    follower makes the step's arrays from each message, as a runner does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = ("127.0.0.1", s.getsockname()[1])
    keys = [distributed.load_keys(keys_dir, i, 2) if keys_dir else None for i in range(2)]
    arrived: list[float] = []
    readers = {}

    def replay(step):
        readers[step.num_decode, step.num_segments](step)
        arrived.append(time.perf_counter())

    follower = threading.Thread(target=distributed.follow, args=(replay, address, 1, 30, {}, keys[1]))
    leader = distributed.Leader(address, 1, print, keys[0])
    follower.start()
    leader.wait_for_followers(30, {})
    medians = {}
    for (bucket, penalised), steps in steps_of.items():
        readers[bucket.num_decode, bucket.num_segments] = _reader(changes)
        sender, trips = StepArrays(), []
        for leaves in steps:
            arrived.clear()
            sent = time.perf_counter()
            leader.send(_message(sender, leaves, bucket, changes))
            while not arrived:
                time.sleep(0)
            trips.append(arrived[0] - sent)
        medians[bucket, penalised] = _median_us(trips)
    leader.close()
    follower.join(10)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    layout = BatchLayout(page_size=16, segment=32, pages_per_chunk=4, table_width=128, vocab_size=49152,
                         history_width=2048)
    steps_of = {case: _steps(layout, *case, args.steps) for case in CASES}
    framing(steps_of)
    with tempfile.TemporaryDirectory() as keys_dir:
        distributed.make_keys(keys_dir, 2)
        curve = {changes: trip(steps_of, keys_dir, changes) for changes in (False, True)}
    plain = {changes: trip(steps_of, None, changes) for changes in (False, True)}
    print("\n| step | CURVE whole us | CURVE changes us | ratio | plain whole us | plain changes us | ratio |\n"
          "|---|---|---|---|---|---|---|")
    for case in CASES:
        print(f"| {_name(*case)} | {curve[False][case]:.0f} | {curve[True][case]:.0f} | "
              f"{curve[True][case] / curve[False][case]:.2f}x | {plain[False][case]:.0f} | {plain[True][case]:.0f} | "
              f"{plain[True][case] / plain[False][case]:.2f}x |")


if __name__ == "__main__":
    main()
