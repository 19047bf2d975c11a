"""What the channel between processes costs per step: framing (msgspec against the pickle it
replaced) and a leader-to-follower trip over loopback, with CURVE and without.

    python tools/bench_channel.py [--steps 300]

The steps are steps of the default SmolLM2 layout with every decode row taken by a sequence
sampling at temperature 0.7, no penalties, masks or biases (the arrays a real step of that bucket
sends; their [rows, max_model_len] token history and [rows, vocab / 32] masks are one value
throughout, sent as that value alone). The framing time includes making the message from the
step's arrays and the follower's arrays from it.
"""

from __future__ import annotations

import argparse
import pickle
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve import distributed  # noqa: E402
from jaxserve.device_calls import Array, Inbox, Outbox, Step  # noqa: E402
from jaxserve.engine.batch import BatchLayout, Bucket  # noqa: E402
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402

BUCKETS = (Bucket(1, 0), Bucket(16, 0), Bucket(64, 0), Bucket(64, 4))


def _step(layout: BatchLayout, bucket: Bucket):
    params = SamplingParams(temperature=0.7)
    decodes = tuple(ScheduledSequence(str(i), (5 + i,), 100 + i, tuple(range(1 + 16 * i, 17 + 16 * i)), True, params,
                                      seed=i, num_output_tokens=3) for i in range(bucket.num_decode))
    batch, _ = layout.build(SchedulerOutput(decodes), bucket)
    return batch, _message(batch, bucket)


def _message(batch, bucket: Bucket) -> Step:
    return Step(bucket.num_decode, bucket.num_segments, tuple(map(Array.of, jax.tree.leaves(batch))))


def _median_us(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def framing(layout: BatchLayout, repeats: int) -> None:
    print("| bucket | KiB | msgspec frame+read us | pickle dumps+loads us | ratio |\n|---|---|---|---|---|")
    for bucket in BUCKETS:
        batch, step = _step(layout, bucket)
        outbox, inbox = Outbox(), Inbox()
        ours = _median_us(lambda: [a.value() for a in inbox.read(outbox.frame(_message(batch, bucket))).leaves],
                          repeats)
        theirs = _median_us(lambda: pickle.loads(pickle.dumps(("step", batch), pickle.HIGHEST_PROTOCOL)), repeats)
        size = len(Outbox().frame(step)) / 1024
        print(f"| {bucket.num_decode}x{bucket.num_segments} | {size:.0f} | {ours:.0f} | {theirs:.0f} | "
              f"{theirs / ours:.2f}x |")


def trip(layout: BatchLayout, steps: int, keys_dir: str | None) -> dict[Bucket, float]:
    """Median send-to-replay microseconds per bucket, one follower thread over loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = ("127.0.0.1", s.getsockname()[1])
    keys = [distributed.load_keys(keys_dir, i, 2) if keys_dir else None for i in range(2)]
    arrived: list[float] = []
    follower = threading.Thread(target=distributed.follow, args=(
        lambda call: arrived.append(time.perf_counter()), address, 1, 30, {}, keys[1]))
    leader = distributed.Leader(address, 1, print, keys[0])
    follower.start()
    leader.wait_for_followers(30, {})
    medians = {}
    for bucket in BUCKETS:
        _, step = _step(layout, bucket)
        trips = []
        for _ in range(steps):
            arrived.clear()
            sent = time.perf_counter()
            leader.send(step)
            while not arrived:
                time.sleep(0)
            trips.append(arrived[0] - sent)
        medians[bucket] = statistics.median(trips) * 1e6
    leader.close()
    follower.join(10)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    layout = BatchLayout(page_size=16, segment=32, pages_per_chunk=4, table_width=128, vocab_size=49152,
                         history_width=2048)
    framing(layout, args.steps)
    with tempfile.TemporaryDirectory() as keys_dir:
        distributed.make_keys(keys_dir, 2)
        curve = trip(layout, args.steps, keys_dir)
    plain = trip(layout, args.steps, None)
    print("\n| bucket | CURVE trip us | plain trip us | CURVE / plain |\n|---|---|---|---|")
    for bucket in BUCKETS:
        print(f"| {bucket.num_decode}x{bucket.num_segments} | {curve[bucket]:.0f} | {plain[bucket]:.0f} | "
              f"{curve[bucket] / plain[bucket]:.2f}x |")


if __name__ == "__main__":
    main()
