"""Host overhead of the engine loop: per step kind, the host milliseconds (schedule, prepare the
step's arrays, launch it, read the tokens back and update the requests, make the outputs) against
the device milliseconds (the wait for the step's tokens), and the share of wall time the device sat
idle waiting for the host. `launch` is the device calls' time on the engine thread: on a CPU
mostly XLA:CPU's own (256 decodes: 0.7-1.7 ms back to back, 2.4-3.3 ms after an idle spell,
where a trivial program over the same arguments takes 0.04 ms; README, "bench_host").

    python tools/bench_host.py                          # the embedded SmolLM2, 8/64/256 sequences
    python tools/bench_host.py --tiny --num-seqs 64     # a tiny random model with the real vocabulary

`--tiny` writes a random Llama checkpoint (4 layers, hidden 256, SmolLM2's tokenizer and 49,152
token vocabulary) to a temporary folder: its device step is short, as an accelerator's is, so the
host's share shows. Each size runs with async scheduling off, then on (`--no-serial`: on only,
and the device's idle share is then unknown: the serial run gives its busy time).
Every request has a 32-token prompt and makes `--output-tokens` tokens (EOS
ignored, greedy); all are queued at once, so `--num-seqs` of them run together. Requests ask for
their final output only, as `LLM.generate`'s do (`--output-kind cumulative delta` for what
streams ask for: an output at every step). With `--structured` each request also has a JSON
schema of its own (a string field named after it), and the `masks` column shows the host time
llguidance spends filling the allowed-token masks; `--structured 8`: every 8th request only.
Under async scheduling such a step is launched up to its logits and sampled once the grammars
have the last token (the step's second program); a first, untimed pass of the same requests
keeps first uses out of the figures.
Each run reports the garbage collector's pauses; the start-up heap is frozen and young objects
collected less often, as a server's are (`--unfrozen`: each run again with Python's settings).
`--logprobs N`: every request asks for its tokens' logprobs and N top ones (what a stream then
carries grows with it: `--output-kind delta --output-tokens 448`).
`--no-model`: `schedule`, the step's arrays and `update` alone (`--temperature`, `--penalized` and
`--max-model-len` apply).
`--max-model-len` (default 512): with `--penalized`, a penalised row's token history is this wide
(8192 is SmolLM2's own context length, the engine's default for it).
`--host-core`: the engine thread on a core of its own, XLA's threads on the others, as a host
beside an accelerator has its cores (otherwise both share every core; 256 decodes of the tiny
model spent as much host time a step either way: README, "bench_host").
`--server`: the requests go through `AsyncEngine` with the server's metrics, and each is read as the
server reads a reply: a final-only one (a reply sent whole) awaits its output, a delta one (a
stream) goes through `serving.merged` and `TextDeltas` on the event loop, which takes its share of
the one interpreter lock (figures: README, "output_kind"); a cumulative one is read as outputs
its stream adds up, as a library's consumer of `AsyncEngine` reads them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxserve.bench.offline import DEFAULT_WORKLOAD, read_workload

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=256,
            intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, torch_dtype="float32")


def write_tiny_model(directory: Path) -> Path:
    """A random-weight HF checkpoint (safetensors, config, SmolLM2's tokenizer), no torch needed."""
    from safetensors.numpy import save_file

    from jaxserve.checkpoint.default_model import default_model_path
    from jaxserve.tokenizer import load_tokenizer

    c = TINY
    d, ffn, head_dim = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    rng = np.random.default_rng(0)

    def random(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    tensors = {"model.embed_tokens.weight": random(c["vocab_size"], d), "model.norm.weight": np.ones(d, np.float32)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": random(d, d), p + "self_attn.k_proj.weight": random(kv, d),
                    p + "self_attn.v_proj.weight": random(kv, d), p + "self_attn.o_proj.weight": random(d, d),
                    p + "mlp.gate_proj.weight": random(ffn, d), p + "mlp.up_proj.weight": random(ffn, d),
                    p + "mlp.down_proj.weight": random(d, ffn), p + "input_layernorm.weight": np.ones(d, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(d, np.float32)}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(c))
    load_tokenizer(default_model_path()).save_pretrained(directory)
    return directory


def schema(index: int) -> dict:
    """A JSON schema per request: distinct, so each is compiled, and open-ended (a free string)."""
    return {"type": "object", "properties": {f"note_{index}": {"type": "string"}}, "required": [f"note_{index}"]}


def run(model: str | None, loaded, num_seqs: int, output_tokens: int, prompts: list[list[int]], structured: int,
        async_scheduling: bool = True, output_kind: str = "final_only", penalized: bool = False,
        freeze: bool = True, server: bool = False, temperature: float = 0.0, top_p: float = 1.0,
        logprobs: int | None = None, max_model_len: int = 512):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import LLMEngine
    from jaxserve.host_memory import freeze_startup_heap
    from jaxserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    config = EngineConfig(model=model, max_num_seqs=num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=max(512, num_seqs * 2), kv_cache_gb=1.0,
                          enable_prefix_caching=False, async_scheduling=async_scheduling)
    started = time.perf_counter()
    engine = LLMEngine(config, model=loaded)
    startup = time.perf_counter() - started
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=output_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind[output_kind.upper()],
                            frequency_penalty=0.5 if penalized else 0.0, presence_penalty=0.3 if penalized else 0.0,
                            logprobs=logprobs)
    requests = [(prompts[i % len(prompts)], dataclasses.replace(params, structured_outputs=StructuredOutputsParams(
        json=schema(i)) if structured and i % structured == 0 else None)) for i in range(num_seqs)]
    if structured and async_scheduling:   # first uses stay out of the figures
        started = time.perf_counter()
        _run_offline(engine, requests)
        engine.runner.wait_compiled()
        print(f"(a first pass of the same requests: {time.perf_counter() - started:.2f} s)")
    threshold = gc.get_threshold()
    if freeze:
        freeze_startup_heap()   # as a server does once started
    pauses = _GCPauses()
    times = []
    engine.step_observer = times.append
    gc.callbacks.append(pauses)
    try:
        if server:
            started = asyncio.run(_serve(engine, requests, times))
        else:
            started = _run_offline(engine, requests)
    finally:
        gc.callbacks.remove(pauses)
        gc.unfreeze()   # the next run's engine replaces this one: the collector may take it
        gc.set_threshold(*threshold)   # and an --unfrozen run has Python's
    return times, time.perf_counter() - started, startup, engine.model, pauses


def _run_offline(engine, requests: list) -> float:
    """The requests queued at once, then steps until all finish. Returns when they were queued
    (perf_counter)."""
    for prompt, params in requests:
        engine.add_request(prompt, params)
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return started


async def _serve(engine, requests: list, times: list) -> float:
    """The requests through `AsyncEngine`, the server's metrics its observer, each read as the server
    reads it: a final-only one awaits its output, a delta one (a stream) goes through `merged` and
    `TextDeltas`; a cumulative one is read as a library's consumer reads it, summed by its stream.
    Returns when they were sent (perf_counter)."""
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.sampling_params import RequestOutputKind
    from jaxserve.server.metrics import Metrics
    from jaxserve.server.serving import TextDeltas, admit, final_outputs, merged

    served = AsyncEngine(engine, observer=Metrics("bench", lambda: served.stats))
    await served.start()
    await served.wait_ready()

    def observe(engine):   # on the engine thread, after it set its own hook: both are told
        metrics = engine.step_observer
        engine.step_observer = lambda step: (times.append(step), metrics(step))
    await served.call(observe)

    async def one(i, prompt, params):
        streams = await admit(served, [prompt], params, f"bench-{i}")
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            return await final_outputs(streams)
        if params.output_kind == RequestOutputKind.CUMULATIVE:
            return [output async for output in streams[0]]
        deltas = TextDeltas(1)
        async for _, output in merged(streams):
            deltas.updates(0, output)

    started = time.perf_counter()
    await asyncio.gather(*(one(i, *request) for i, request in enumerate(requests)))
    await served.stop()
    return started


class _GCPauses:
    """The garbage collector's pauses during a run (a `gc.callbacks` entry)."""

    def __init__(self):
        self.seconds: list[float] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds.append(time.perf_counter() - self._started)


def report(label: str, num_seqs: int, times, wall: float, startup: float, serial_device: float | None,
           pauses: _GCPauses, overlapped: bool = False) -> None:
    """`serial_device`: the seconds the host waited for the device with async scheduling off, the
    device's busy time; with it on, the rest of the wall time is the device's idle time.
    `overlapped`: async scheduling ran this one, so without `serial_device` the device's idle time
    is unknown (the host works while the device runs the step before)."""
    by_kind = collections.defaultdict(list)
    for t in times:
        by_kind[t.kind].append(t)
    host = sum(t.host for t in times)
    device = sum(t.device for t in times)
    tokens = sum(t.num_seqs for t in times if t.kind == "decode")
    if serial_device is not None:
        idle = f"device idle ~{max(0.0, 1 - serial_device / wall):.1%} of wall time (busy as in the serial run)"
    elif overlapped:
        idle = (f"host work {host / (host + device):.1%} of step time (the device's idle share needs "
                f"the run with async scheduling off: without --no-serial)")
    else:   # serial steps: the device is idle exactly while the host works
        idle = f"device idle (waiting for the host) {host / (host + device):.1%} of step time"
    print(f"\n{label}, {num_seqs} sequences: {len(times)} steps in {wall:.2f} s, {tokens / wall:.1f} decode "
          f"tok/s (start-up {startup:.1f} s); {idle}; garbage collector: {len(pauses.seconds)} pauses, "
          f"{sum(pauses.seconds) * 1e3:.0f} ms in all, the longest {max(pauses.seconds, default=0) * 1e3:.0f} ms")
    print(f"  {'kind':8} {'steps':>6} {'seqs':>6} {'schedule':>9} {'masks':>9} {'prepare':>9} {'launch':>9} "
          f"{'update':>9} {'outputs':>9} {'host':>9} {'device':>9}   (medians, ms)")
    for kind in ("prefill", "mixed", "decode"):
        rows = by_kind.get(kind)
        if not rows:
            continue

        def med(field):
            return statistics.median(getattr(t, field) for t in rows) * 1e3

        print(f"  {kind:8} {len(rows):6d} {statistics.median(t.num_seqs for t in rows):6.0f} {med('schedule'):9.2f} "
              f"{med('masks'):9.2f} {med('prepare'):9.2f} {med('launch'):9.2f} {med('update'):9.2f} "
              f"{med('outputs'):9.2f} {med('host'):9.2f} "
              f"{med('device'):9.2f}")


def no_model(num_seqs: int, prompts: list[list[int]], temperature: float, penalized: bool, max_model_len: int,
             steps: int = 300) -> None:
    """The host's own work of a step without a model: `Scheduler.schedule`, the step's arrays
    (`BatchLayout.build`, sampling arrays included, at the engine's default page and segment sizes
    and bucket) and `Scheduler.update`, for `num_seqs` decoding requests that each sample token 5
    at every step. As under async scheduling, step N+1 is scheduled and laid out before step N is
    read back, so its decodes are placeholders. No XLA threads share the cores: steadier figures
    than a run with a model, for comparing versions of this code."""
    from jaxserve.engine.batch import BatchLayout
    from jaxserve.engine.page_allocator import PageAllocator
    from jaxserve.engine.penalty_slots import PenaltySlots
    from jaxserve.engine.request import Request
    from jaxserve.engine.runner import smallest_bucket, step_buckets
    from jaxserve.engine.scheduler import Scheduler, SchedulerConfig
    from jaxserve.sampling_params import SamplingParams

    page_size, segment, budget = 16, 16, max(512, num_seqs * 2)
    params = SamplingParams(temperature=temperature, max_tokens=steps + 2, ignore_eos=True,
                            frequency_penalty=0.5 if penalized else 0.0, presence_penalty=0.3 if penalized else 0.0)
    scheduler = Scheduler(SchedulerConfig(num_seqs, budget, segment), PageAllocator(num_seqs * 40, page_size))
    table_width = -(-max_model_len // page_size)
    layout = BatchLayout(page_size, segment, 1, table_width, 49152, max_model_len, num_seqs)
    buckets, slots = step_buckets(num_seqs, budget, segment), PenaltySlots(num_seqs)
    for i in range(num_seqs):
        scheduler.add(Request(f"r{i}", prompts[i % len(prompts)], params, seed=i, max_total_tokens=max_model_len))
    times, in_flight, previous_rows = [], None, {}
    for _ in range(steps):
        started = time.perf_counter()
        output = scheduler.schedule()
        scheduled = time.perf_counter()
        _, rows = layout.build(output, smallest_bucket(buckets, layout.needs(output)), 1, previous_rows, slots)
        built = time.perf_counter()
        if in_flight is not None:
            scheduler.update(in_flight, {s.request_id: (5,) for s in in_flight.sequences if s.samples})
        times.append((scheduled - started, built - scheduled, time.perf_counter() - built))
        in_flight, previous_rows = output, {s.request_id: i for i, s in enumerate(rows) if s is not None}
    decodes = times[steps // 4:]   # after the prompts
    print(f"no model, {num_seqs} decoding sequences: schedule {statistics.median(t[0] for t in decodes) * 1e3:.3f}, "
          f"layout {statistics.median(t[1] for t in decodes) * 1e3:.3f}, update "
          f"{statistics.median(t[2] for t in decodes) * 1e3:.3f}, in all "
          f"{statistics.median(sum(t) for t in decodes) * 1e3:.3f} ms a step (medians of {len(decodes)} steps)")


def give_the_host_a_core() -> str:
    """This (the engine's) thread alone on the first core, XLA:CPU's threads on the others: they
    start with its client, on the cores of the thread that starts it (Linux affinity is per
    thread). Returns the split, for the report."""
    import jax

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"--host-core needs 2 cores or more; this process may use {len(cores)}")
    os.sched_setaffinity(0, cores[1:])
    jax.devices()
    os.sched_setaffinity(0, cores[:1])
    return f"host on core {cores[0]}, XLA on {', '.join(map(str, cores[1:]))}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead (see above)")
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD, help="prompts: the first 32 tokens of each")
    parser.add_argument("--structured", type=int, nargs="?", const=1, default=0, metavar="K",
                        help="a JSON schema for every K-th request, by default every one (see above)")
    parser.add_argument("--no-serial", action="store_true", help="skip the run with async scheduling off")
    parser.add_argument("--penalized", action="store_true", help="frequency and presence penalties on every request")
    parser.add_argument("--max-model-len", type=int, default=512,
                        help="the engine's (default 512); a penalised row's token history is this wide")
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (default 0: greedy)")
    parser.add_argument("--logprobs", type=int, default=None,
                        help="every request asks for its tokens' logprobs and this many top ones")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's (default 1: off)")
    parser.add_argument("--output-kind", nargs="+", default=["final_only"], choices=["cumulative", "delta", "final_only"],
                        help="what each request's outputs hold (RequestOutputKind); final_only is what LLM.generate "
                             "asks for, cumulative and delta what streams get; several: each in turn")
    parser.add_argument("--unfrozen", action="store_true",
                        help="each run again without freezing the start-up heap (host_memory.freeze_startup_heap)")
    parser.add_argument("--no-model", action="store_true",
                        help="time schedule, layout and update alone, without a model (see above)")
    parser.add_argument("--server", action="store_true", help="through AsyncEngine, read as the server reads "
                                                              "replies (see above)")
    parser.add_argument("--host-core", action="store_true",
                        help="the engine thread on a core of its own, XLA's on the others (see above)")
    args = parser.parse_args()
    cores = give_the_host_a_core() if args.host_core else None

    from jaxserve.host_memory import keep_freed_memory

    keep_freed_memory()
    prompts = [r["prompt_token_ids"][:32] for r in read_workload(args.workload, None)]
    if args.no_model:
        for num_seqs in args.num_seqs:
            no_model(num_seqs, prompts, args.temperature, args.penalized, args.max_model_len)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_model(Path(tmp))) if args.tiny else args.model
        label = "tiny random model" if args.tiny else (model or "embedded SmolLM2")
        loaded = None
        label += f", a JSON schema for 1 request in {args.structured}" if args.structured else ""
        label += ", penalised" if args.penalized else ""
        label += f", max_model_len {args.max_model_len}" if args.max_model_len != 512 else ""
        label += f", temperature {args.temperature}" if args.temperature else ""
        label += f", logprobs={args.logprobs}" if args.logprobs is not None else ""
        label += f", top_p {args.top_p}" if args.top_p < 1 else ""
        label += f", {cores}" if cores else ""
        for num_seqs in args.num_seqs:
            for kind in args.output_kind:
                serial_device = None
                for async_scheduling in (False, True)[args.no_serial:]:
                    for freeze in (True, False)[:1 + args.unfrozen]:
                        times, wall, startup, loaded, pauses = run(
                            model, loaded, num_seqs, args.output_tokens, prompts, args.structured, async_scheduling,
                            kind, args.penalized, freeze, args.server, args.temperature, args.top_p,
                            args.logprobs, args.max_model_len)
                        report(f"{label}, {kind} outputs{', through AsyncEngine' if args.server else ''}, "
                               f"async scheduling {'on' if async_scheduling else 'off'}"
                               f"{'' if freeze else ', start-up heap not frozen'}",
                               num_seqs, times, wall, startup, serial_device, pauses, async_scheduling)
                    serial_device = sum(t.device for t in times)


if __name__ == "__main__":
    main()
