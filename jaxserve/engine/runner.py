"""Runs scheduled steps on the device: owns the weights, the KV pool and the compiled programs.

The runner makes no policy decisions. It picks the smallest compiled shape (bucket) that holds a
step, builds that step's arrays and calls the jitted step, whose KV pool is donated and returned.
A step runs as two programs: the model up to the sampling rows' logits (one per bucket), then
the sampling (one per number of logit rows, which buckets share). Every bucket's are compiled at
start-up (`warm_up`; not with enforce_eager, where each compiles on its first step), so serving
never compiles, except for programs that score prompt tokens. Over several CPU processes a step is
one program, and steps sampling for constrained sequences take a split pair compiled in the
background (`_compile_split`).

Over several processes (`jaxserve.distributed`), process 0's runner sends each device call's host
inputs to `followers` first; the other processes' runners `replay` them, so every process makes
the same calls in the same order.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.config import ModelConfig
from jaxserve.device_calls import (
    Array, CompileSplit, CopyPages, DeviceCall, LoadLora, ProtocolError, ResetPool, Step, StepArrays, StepSample)
from jaxserve.engine import kv_pages as kv_pool
from jaxserve.engine.batch import BatchLayout, Bucket, StepInput
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from jaxserve.engine.output import TokenLogprob
from jaxserve.engine.prompt_logprobs import PromptLogprobs
from jaxserve.engine.rejection_sampler import accepted_length
from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.engine.sampler import Sampled, Samples, allowed_rows
from jaxserve.engine.step import compile_copy_pages, compile_forward, compile_split_step, compile_step, over_gloo
from jaxserve.models.layers.attention import MeshAttention, backend_for
from jaxserve.sampling_params import SamplingParams
from jaxserve.models.layers import float8, lora
from jaxserve.models.llama import lora_shapes
from jaxserve.sharding import BATCH_SPEC, pad_lora_heads, place, sharding_for

log = logging.getLogger(__name__)

KV_CHUNK_TOKENS = 64  # default context visited per attention loop iteration


def _powers(limit: int) -> list[int]:
    """1, 2, 4, ... below `limit`, then `limit`."""
    return [2**i for i in range(limit.bit_length()) if 2**i < limit] + [limit]


def step_buckets(max_num_seqs: int, max_num_batched_tokens: int, segment: int) -> list[Bucket]:
    """The compiled shapes, smallest first: decode-only steps of 1, 2, 4, ... max_num_seqs slots,
    and steps of 1, 2, 4, ... prefill segments (up to the token budget) with as many decode slots
    as their segments' tokens, at most max_num_seqs.

    About log2(max_num_seqs) + log2(budget / segment) programs: 12 at the defaults, where the
    decode x segment grid compiled 48. A step takes the smallest bucket that holds it. Padded
    decode slots cost little: their block tables point at page 0, and a group without a real row
    visits no context at all. On anchor-64 the two sets padded 15,325 and 15,229 tokens and gave
    the same throughput (57.6 against 54.9 tokens/s, one run). Decode-only steps get no padded
    segments: 64 padded tokens cost a 64-sequence step as much matrix work as its real ones.
    (Small decode buckets matter: on SmolLM2 a 1-row step took 60 ms and an 8-row one 112 ms.)
    """
    decode = [Bucket(d, 0) for d in _powers(max_num_seqs)]
    mixed = [Bucket(min(max_num_seqs, p * segment), p) for p in _powers(max_num_batched_tokens // segment)]
    return sorted(set(decode + mixed), key=_bucket_order(segment))


def speculative_buckets(max_speculating_seqs: int, num_speculative_tokens: int, max_num_batched_tokens: int,
                        segment: int) -> list[Bucket]:
    """Steps whose decode slots hold 1 + K tokens (a last token and its drafts): 1, 2, 4, ... slots
    alone, and all the slots beside 1, 2, 4, ... prefill segments (drafts beside a chunked prompt),
    as many as the token budget holds (the scheduler gives drafts only in steps of at most
    `max_speculating_seqs` sequences)."""
    slot = 1 + num_speculative_tokens
    most = min(max_speculating_seqs, max_num_batched_tokens // slot)
    if most < 1:
        return []
    decode = [Bucket(d, 0, slot) for d in _powers(most)]
    mixed = [Bucket(most, p, slot) for p in _powers((max_num_batched_tokens - most) // segment) if p >= 1]
    return decode + mixed


def _bucket_order(segment: int):
    return lambda b: (b.num_tokens(segment), b.num_segments, b.decode_len)


def _holds(bucket: Bucket, need: Bucket) -> bool:
    return (bucket.num_decode >= need.num_decode and bucket.num_segments >= need.num_segments
            and bucket.decode_len >= need.decode_len)


def _scores(batch: StepInput) -> bool:
    """Whether the step scores prompt tokens, which picks its program (step.py's `score`).
    Followers replaying the step read the same targets, so they pick the same program."""
    return bool((batch.prompt_target >= 0).any())


def _stop_and_join(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    thread.join()


def smallest_bucket(buckets: list[Bucket], need: Bucket) -> Bucket:
    """The first of `buckets` (smallest first) with room for `need`'s decodes and segments."""
    for bucket in buckets:
        if _holds(bucket, need):
            return bucket
    raise ValueError(f"a step of {need} exceeds the largest compiled bucket {buckets[-1]}")


def _read_rows(rows: list[ScheduledSequence | None], samples: Samples, sampled: list[int], finite: list[bool],
               wants_logprobs: list[bool]) -> tuple[dict, dict, set]:
    """`StepResult`'s tokens, logprobs and non-finite ids from a step's rows, any of them with drafts."""
    tokens, logprobs, non_finite = {}, {}, set()
    all_finite = all(finite)   # no row to check alone
    end = 0   # a sequence with drafts samples at consecutive rows: after its last token and each draft
    for first, seq in enumerate(rows):
        if seq is None or first < end:
            continue
        end = first + 1 + len(seq.draft_token_ids)
        end_kept = first + accepted_length(sampled[first:end], seq.draft_token_ids) if seq.draft_token_ids else end
        if not all_finite and not all(finite[first:end_kept]):
            non_finite.add(seq.request_id)
            continue
        tokens[seq.request_id] = tuple(sampled[first:end_kept])
        if wants_logprobs[first]:
            k = seq.params.logprobs or 0
            logprobs[seq.request_id] = tuple(TokenLogprob(sampled[i], float(samples.logprob[i]), tuple(
                zip(samples.top_ids[i, :k].tolist(), samples.top_logprobs[i, :k].tolist())))
                for i in range(first, end_kept))
    return tokens, logprobs, non_finite


def resolve_backend(name: str) -> str:
    """`auto`: the Pallas kernels where they compile (TPU, GPU), plain XLA otherwise."""
    if name == "auto":
        return "pallas" if jax.default_backend() in ("tpu", "gpu") else "xla"
    return name


class Followers(Protocol):
    """The other processes of a multi-process engine (`jaxserve.distributed.Leader`)."""

    def send(self, call: DeviceCall) -> None: ...


@dataclasses.dataclass(frozen=True)
class LaunchedStep:
    """A step on its way through the device: `Runner.collect` reads it back."""

    output: SchedulerOutput
    bucket: Bucket
    batch: StepInput                        # its host arrays
    rows: list[ScheduledSequence | None]    # the sequence sampled at each logit row
    samples: object                         # Samples, on the device
    prompt: object                          # PromptLogprobs, on the device
    prepare_s: float                        # seconds to lay it out: page copies made, host arrays built
    launch_s: float                         # seconds of its device calls: its arrays sent and placed, its
                                            # program called (on a CPU mostly XLA:CPU's own time)
    logits: tuple | None = None             # launched with `masks_later` and not sampled yet: (logits, input
                                            # tokens) on the device, or None if nothing was launched yet (its
                                            # bucket's split still compiling)

    @property
    def waits_for_masks(self) -> bool:
        """Launched with `masks_later`, not sampled yet (`Runner.sample`)."""
        return self.samples is None


@dataclasses.dataclass(frozen=True)
class StepResult:
    tokens: dict[str, tuple[int, ...]]      # sampled, for each sequence whose chunk reached its end: one
                                            # token, or after drafts the confirmed drafts and one more
    logprobs: dict[str, tuple[TokenLogprob, ...]]   # of those tokens, where the params ask for them
    non_finite: set[str]                    # sequences whose logits were NaN or inf: no token for them
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprob]]]   # prompt_logprobs sequences: (position,
                                                                  # logprob of the prompt token after it)
    wait_s: float = 0.0                     # of `collect`'s time, the wait for the device's arrays


class Runner:
    def __init__(self, model, pages_per_slice: int | None, page_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, prefill_segment: int, kv_chunk_tokens: int = KV_CHUNK_TOKENS,
                 attention_backend: str = "xla", followers: Followers | None = None, kv_cache_dtype: str = "auto",
                 speculative_buckets: list[Bucket] = (), model_index: int = 0, max_loras: int = 0,
                 max_lora_rank: int = 16):
        self.model = model
        self.followers = followers
        self.model_index = model_index   # in device calls sent to followers: 0 the target, 1 a draft model
        self.attention_backend = resolve_backend(attention_backend)
        self.kv_dtype = kv_pool.resolve_kv_dtype(kv_cache_dtype, model.dtype)
        if self.attention_backend == "xla" and not over_gloo(model.mesh):   # the kernels read float8 itself
            self.kv_dtype = float8.stored_dtype(self.kv_dtype)             # fp8 pages as bytes on a CPU
        pages_per_chunk = max(1, kv_chunk_tokens // page_size)
        table_width = math.ceil(math.ceil(max_model_len / page_size) / pages_per_chunk) * pages_per_chunk
        self.layout = BatchLayout(page_size, prefill_segment, pages_per_chunk, table_width,
                                  model.config.vocab_size, max_model_len, max_num_seqs)
        self.num_slices = kv_pool.num_data_slices(model.mesh)   # limits and sizes below are per slice
        self.max_copies = max_num_seqs * self.num_slices   # page copies per call: one per sequence a step
        self.buckets = sorted(step_buckets(max_num_seqs, max_num_batched_tokens, prefill_segment)
                              + list(speculative_buckets), key=_bucket_order(prefill_segment))
        self.page_size = page_size
        self.kv_pages = None   # allocated here, or by `allocate_pool` once its size is known (step_bytes)
        if pages_per_slice is not None:
            self.allocate_pool(pages_per_slice)
        attention = backend_for(model.config, self.attention_backend, pages_per_chunk)
        self._batch_sharding = None
        if model.mesh is not None:
            attention = MeshAttention(attention, model.mesh, scaled=kv_pool.is_scaled(self.kv_dtype))
            self._batch_sharding = NamedSharding(model.mesh, BATCH_SPEC)
        # LoRA: slot 0 (no adapter) and `max_loras` slots for resident adapters; None without LoRA
        self.lora = self._allocate_lora(max_loras + 1, max_lora_rank) if max_loras else None
        self.lora_bytes = sum(x.nbytes for x in jax.tree.leaves(self.lora))
        # A step as two programs, so that buckets with as many logit rows share the second: the
        # 12 shapes of the defaults compile 18 programs, and the embedded model was ready in
        # 19.1-20.4 s against 24.3-25.3 s with 12 whole steps (README). As one program over
        # several processes on CPUs, whose gloo collectives mismatched with two (see `over_gloo`).
        self._fused = over_gloo(model.mesh)
        self._step = compile_step(model.graphdef, attention, model.mesh)
        self._logits_step, self._sample_step = compile_split_step(model.graphdef, attention, model.mesh)
        # Fused steps only: the buckets whose split programs are compiled (the engine thread reads
        # the set, the compiling thread adds to it), and the compile of each bucket sent to that thread.
        self._split_ready: set[Bucket] = set()
        self._split_compiles: dict[Bucket, concurrent.futures.Future] = {}
        self._split_compiler: concurrent.futures.ThreadPoolExecutor | None = None
        self._replayed_logits: tuple | None = None   # a follower's step run to its logits: (logits, batch)
        self._forward = compile_forward(model.graphdef, attention)
        self._copy_pages = compile_copy_pages()
        self._templates: dict[Bucket, tuple] = {}   # bucket -> (treedef, leaves) of an empty step, for replays
        self._step_arrays = StepArrays()   # the last step sent (process 0) or replayed (a follower)
        # The last step's sampled tokens stay on the device for the next step's placeholders:
        # `_sampled.tokens` holds them in its first rows, `_sampled_rows` says whose they are.
        # Penalised sequences' token counts stay there too, a slot each (`_penalty_slots`): as
        # many slots as a step has sampling rows at most.
        self._num_rows = max(map(self.layout.num_logit_rows, self.buckets)) * self.num_slices
        self._sampled = self._new_sampled()
        self._sampled_rows: dict[str, int] = {}
        self._penalty_slots = PenaltySlots(self._num_rows)
        # The buckets a step may take: all (each compiled on first use, or by warm_up), or while
        # the rest compile in the background, those compiled so far.
        self._ready: list[Bucket] | None = None
        self._compiling: threading.Thread | None = None

    def bucket_for(self, output: SchedulerOutput) -> Bucket:
        return smallest_bucket(self.ready_buckets, self.layout.needs(output, self.num_slices))

    def devices(self) -> list:
        """The devices the weights and the pool live on."""
        if self.model.mesh is not None:
            return list(self.model.mesh.devices.flat)
        return list(jax.tree.leaves(self.model.params)[0].devices())

    def allocate_pool(self, pages_per_slice: int) -> None:
        self.kv_pages = kv_pool.allocate(self.model.config, pages_per_slice, self.page_size, self.kv_dtype,
                                         self.model.mesh)

    def step_bytes(self) -> int:
        """Temporary bytes per device of the largest bucket's step: compiled (once, and thrown away)
        over a pool of the smallest size, since a step's temporaries do not grow with the pool."""
        pool = kv_pool.abstract(self.model.config, self.layout.table_width + 1, self.page_size, self.kv_dtype,
                                self.model.mesh)
        batch, _ = self.layout.build(SchedulerOutput(()), self.buckets[-1], self.num_slices)
        # As one program: it holds the model's temporaries, the logits and the sampling's at once,
        # at least what either of the split pair holds.
        compiled = self._step.lower(self.model.params, pool, self._sampled, self.lora, self._place(batch),
                                    score=True).compile()
        return int(compiled.memory_analysis().temp_size_in_bytes)

    def warm_up(self, progress: Callable[[int, int], None] | None = None, background: bool = False) -> None:
        """Compiles the step's programs for every bucket. Tracing holds the GIL, so it runs on this
        thread; each program's XLA compile goes to a pool as soon as it is traced: one thread on a
        CPU, whose compiler already spreads one program over the cores (a cold start's 12 programs
        on 2 cores: 24.5-25.1 s one at a time, 25.0-31.0 s two at a time), else one thread per core.
        `progress(done, total)` counts programs.

        With `background`, only the buckets no other holds (every step fits one of them) and the
        smallest (one stream) are compiled before returning; the rest compile on a thread of their
        own while steps run, each taking the smallest compiled bucket it fits meanwhile."""
        first = self.buckets
        if background:
            first = [b for b in self.buckets if b == self.buckets[0] or not any(
                o != b and _holds(o, b) for o in self.buckets)]
        no_copies = np.zeros(self.max_copies, np.int32)
        workers = 1 if self.devices()[0].platform == "cpu" else os.cpu_count() or 1
        sampling_shapes: set[int] = set()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            compiles = [pool.submit(self._copy_pages.lower(self.kv_pages, no_copies, no_copies).compile)]
            compiles += [pool.submit(program.compile) for b in first for program in self._lower(b, sampling_shapes)]
            # The others are traced here, while those compile, over the live arrays (lowered over
            # shapes alone, they were not the programs a step's call looks up): only XLA waits.
            rest = [(b, self._lower(b, sampling_shapes)) for b in self.buckets if b not in first]
            for i, compiled in enumerate(concurrent.futures.as_completed(compiles[1:])):
                compiled.result()
                if progress:
                    progress(i + 1, len(compiles) - 1)
            compiles[0].result()
        if rest:
            self._ready = list(first)
            stop = threading.Event()
            self._compiling = threading.Thread(target=self._compile_rest, args=(rest, stop), daemon=True,
                                               name="jaxserve-compile")
            # At exit the thread finishes the compile it is in, never leaving XLA mid-compile.
            atexit.register(_stop_and_join, stop, self._compiling)
            self._compiling.start()

    def _lower(self, bucket: Bucket, sampling_shapes: set[int]) -> list[jax.stages.Lowered]:
        """`bucket`'s step programs, lowered over the live arrays and an empty step (`_lower_split`),
        or the whole step in one, over several CPU processes."""
        if not self._fused:
            return self._lower_split(bucket, sampling_shapes)
        return [self._step.lower(self.model.params, self.kv_pages, self._sampled, self.lora,
                                 self._place(self._empty_step(bucket)), score=False)]

    def _lower_split(self, bucket: Bucket, sampling_shapes: set[int]) -> list[jax.stages.Lowered]:
        """`bucket`'s logits program, and the sampling program of its number of logit rows unless
        `sampling_shapes` has it already (it is added)."""
        batch = self._place(self._empty_step(bucket))
        logits = self._logits_step.lower(self.model.params, self.kv_pages, self._sampled, self.lora, batch,
                                         score=False)
        rows = self.layout.num_logit_rows(bucket)
        if rows in sampling_shapes:
            return [logits]
        sampling_shapes.add(rows)
        return [logits, self._sample_step.lower(*logits.out_info[:2], self._sampled, batch.sampling)]

    def _compile_rest(self, lowered: list[tuple[Bucket, list[jax.stages.Lowered]]], stop: threading.Event) -> None:
        started = time.perf_counter()
        for bucket, programs in lowered:
            if stop.is_set():
                return
            try:
                for program in programs:
                    program.compile()
            except Exception:  # noqa: BLE001 - steps keep the larger buckets compiled already
                log.exception("compiling the step for %s failed; steps that fit it take a larger one", bucket)
                continue
            # a new list, swapped in whole: the engine thread reads either the old or the new one
            self._ready = sorted([*self._ready, bucket], key=self.buckets.index)
        log.info("compiled the other %d step shapes in the background in %.1f s", len(lowered),
                 time.perf_counter() - started)

    @property
    def ready_buckets(self) -> list[Bucket]:
        """The buckets a step may take now: every one, or during a background warm-up those
        compiled so far."""
        return self.buckets if self._ready is None else self._ready

    def wait_compiled(self) -> None:
        """Returns once every bucket is compiled (a background warm-up has finished), and every
        split step sent to be compiled."""
        if self._compiling is not None:
            self._compiling.join()
        for compiling in list(self._split_compiles.values()):
            compiling.result()

    def launch(self, output: SchedulerOutput, masks_later: bool = False) -> LaunchedStep:
        """Starts one step on the device and returns without waiting for it. Its placeholders take
        their ids from the step launched before. `masks_later`: the step stops at its logits until
        `sample` brings the allowed-token masks; while its bucket's two programs compile (in the
        background, from the first such step that needs them), it waits for `sample` whole."""
        started = time.perf_counter()
        self._make_copies(output.page_copies)
        bucket = self.bucket_for(output)
        batch, rows = self.layout.build(output, bucket, self.num_slices, self._sampled_rows, self._penalty_slots)
        built = time.perf_counter()
        samples = prompt = logits = None
        if not masks_later:
            samples, prompt = self._run_step(batch, bucket)
        elif not self._fused or bucket in self._split_ready:
            logits, prompt = self._run_logits(batch, bucket)
        else:
            self._compile_split(bucket)
        launched = time.perf_counter()
        # A sequence with drafts has no one next token on the device: it is never a placeholder.
        self._sampled_rows = {seq.request_id: i for i, seq in enumerate(rows) if seq is not None
                              and not seq.draft_token_ids}
        return LaunchedStep(output, bucket, batch, rows, samples, prompt,
                            built - started + time.perf_counter() - launched, launched - built, logits)

    def sample(self, step: LaunchedStep, token_masks: dict[str, np.ndarray]) -> LaunchedStep:
        """Samples a step launched with `masks_later`, with each constrained sequence's packed
        allowed-token mask (by id); the step after it may be launched once this returns."""
        started = time.perf_counter()
        allowed = allowed_rows(step.rows, len(step.rows), token_masks, self.model.config.vocab_size)
        batch = step.batch.replace(sampling=step.batch.sampling.replace(allowed=allowed))
        prompt = step.prompt
        built = time.perf_counter()
        if step.logits is None:
            samples, prompt = self._run_step(batch, step.bucket)
        else:
            self._tell_followers(StepSample(Array.of(allowed), self.model_index))
            samples = self._run_sampling(step.logits, batch.sampling)
        return dataclasses.replace(step, batch=batch, samples=samples, prompt=prompt, logits=None,
                                   prepare_s=step.prepare_s + built - started,
                                   launch_s=step.launch_s + time.perf_counter() - built)

    def _compile_split(self, bucket: Bucket) -> None:
        """Where a step is one program: traces `bucket`'s split pair here (over the live arrays and
        an empty step, as `warm_up` does: over several processes each places the same values) and
        compiles it on a thread of its own, one bucket after another. Followers start theirs at
        the same time."""
        if bucket in self._split_compiles:
            return
        self._tell_followers(CompileSplit(bucket.num_decode, bucket.num_segments, bucket.decode_len, self.model_index))
        forward, sampling = self._lower_split(bucket, set())
        if self._split_compiler is None:
            self._split_compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-split")

        def compile_both():
            started = time.perf_counter()
            try:
                forward.compile()
                sampling.compile()
            except Exception:  # noqa: BLE001 - its steps keep waiting for their masks whole
                log.exception("compiling the split step for %s failed", bucket)
                return
            log.info("compiled the split step for %s in %.1f s", bucket, time.perf_counter() - started)
            self._split_ready = self._split_ready | {bucket}   # swapped in whole, as _ready is

        self._split_compiles[bucket] = self._split_compiler.submit(compile_both)

    def _run_logits(self, batch: StepInput, bucket: Bucket) -> tuple[tuple, object]:
        """A step up to its logits, its sampling left for `_run_sampling`."""
        self._send_step(batch, bucket, to_logits=True)
        return self._logits(batch)

    def _logits(self, batch: StepInput) -> tuple[tuple, object]:
        """The step's first program: ((logits, input tokens), prompt logprobs), on the device."""
        logits, last_tokens, prompt, self.kv_pages = self._logits_step(
            self.model.params, self.kv_pages, self._sampled, self.lora, self._place(batch), score=_scores(batch))
        return (logits, last_tokens), prompt

    def _run_sampling(self, logits: tuple, sampling):
        """The step's second program: its samples, on the device."""
        samples, self._sampled = self._sample_step(*logits, self._sampled, self._place(sampling))
        return samples

    def collect(self, step: LaunchedStep) -> StepResult:
        """Waits for a launched step and reads its tokens back (see StepResult)."""
        output, bucket, batch, rows = step.output, step.bucket, step.batch, step.rows
        started = time.perf_counter()
        samples, prompt = jax.device_get(step.samples), step.prompt
        wait_s = time.perf_counter() - started
        # Python lists: indexing numpy per row took 1.1 ms of 256 rows, the lists 0.3-0.4 ms
        sampled, finite, wants_logprobs = (samples.tokens.tolist(), samples.finite.tolist(),
                                           batch.sampling.logprobs.tolist())
        if bucket.decode_len == 1 and all(finite) and not any(wants_logprobs):   # the usual step: a token a row
            found = {seq.request_id: (token,) for seq, token in zip(rows, sampled) if seq is not None}, {}, set()
        else:
            found = _read_rows(rows, samples, sampled, finite, wants_logprobs)
        return StepResult(*found, self._prompt_logprobs(output, bucket, batch, prompt), wait_s)

    def _prompt_logprobs(self, output: SchedulerOutput, bucket: Bucket, batch: StepInput,
                         prompt: PromptLogprobs) -> dict[str, list[tuple[int, TokenLogprob]]]:
        """Each prompt_logprobs sequence's (position, logprob of the prompt token after it)."""
        scored = self.layout.prompt_rows(output, bucket, self.num_slices)
        if not scored:
            return {}   # nothing copied back: the step skipped the scoring
        prompt = jax.device_get(prompt)
        params = {s.request_id: s.params for s in output.sequences}
        found: dict[str, list[tuple[int, TokenLogprob]]] = {}
        for seq_id, position, row in scored:
            k = params[seq_id].prompt_logprobs
            top = tuple(zip(prompt.top_ids[row, :k].tolist(), prompt.top_logprobs[row, :k].tolist()))
            found.setdefault(seq_id, []).append((position, TokenLogprob(
                int(batch.prompt_target[row]), float(prompt.logprob[row]), top, int(prompt.rank[row]))))
        return found

    def replay(self, call: DeviceCall) -> None:
        """A follower process makes the device call that process 0's runner sent."""
        if isinstance(call, Step):
            bucket = Bucket(call.num_decode, call.num_segments, call.decode_len)
            batch = self._step_input(bucket, call.leaves)
            if not call.to_logits:
                self._run_step(batch, bucket)
                return
            if bucket in self._split_compiles:   # as the leader, which sends such steps once compiled
                self._split_compiles[bucket].result()
            self._replayed_logits = self._run_logits(batch, bucket)[0], batch
        elif isinstance(call, StepSample):
            self._replay_sampling(call.allowed.value())
        elif isinstance(call, CompileSplit):
            self._compile_split(Bucket(call.num_decode, call.num_segments, call.decode_len))
        elif isinstance(call, CopyPages):
            self._copy(call.source.value(), call.destination.value())
        elif isinstance(call, ResetPool):
            self.reset_pool()
        elif isinstance(call, LoadLora):
            if self.lora is None:
                raise ProtocolError("a LoRA adapter for an engine without --enable-lora")
            values = [array.value() for array in call.leaves]
            self.lora = lora.load_slot(self.lora, call.slot, {m: (values[2 * i], values[2 * i + 1])
                                                              for i, m in enumerate(self.lora)})
        else:
            raise ProtocolError(f"{type(call).__name__} is not a device call")

    def _replay_sampling(self, allowed: np.ndarray) -> None:
        """A follower samples the step it ran to its logits, with the leader's masks."""
        if self._replayed_logits is None:
            raise ProtocolError("a step's sampling, but no step ran to its logits before it")
        (logits, batch), self._replayed_logits = self._replayed_logits, None
        expected = batch.sampling.allowed
        if (allowed.shape, allowed.dtype) != (expected.shape, expected.dtype):
            raise ProtocolError(f"allowed-token masks {allowed.dtype}{list(allowed.shape)} for a step whose "
                                f"sampling takes {expected.dtype}{list(expected.shape)}")
        self._run_sampling(logits, batch.sampling.replace(allowed=allowed))

    def _empty_step(self, bucket: Bucket) -> StepInput:
        """The arrays of a step of `bucket` with nothing in it; a bucket must be one of this runner's."""
        if bucket not in self.buckets:
            raise ProtocolError(f"step bucket {bucket} is not one of this engine's {self.buckets}")
        return self.layout.build(SchedulerOutput(()), bucket, self.num_slices)[0]

    def _step_input(self, bucket: Bucket, arrays) -> StepInput:
        """A step's arrays, as sent, back in a StepInput; they must be the shapes this runner built."""
        if bucket not in self._templates:
            leaves, treedef = jax.tree.flatten(self._empty_step(bucket))
            self._templates[bucket] = treedef, [(leaf.shape, leaf.dtype.str) for leaf in leaves]
        treedef, expected = self._templates[bucket]
        got = [(tuple(array.shape), array.dtype) for array in arrays]   # checked before any is made
        if got != expected:
            raise ProtocolError(f"a step of bucket {bucket} with arrays {got}, where this engine builds {expected}")
        return jax.tree.unflatten(treedef, self._step_arrays.receive(arrays))

    def _tell_followers(self, call: DeviceCall) -> None:
        if self.followers is not None:
            self.followers.send(call)

    def _send_step(self, batch: StepInput, bucket: Bucket, to_logits: bool = False) -> None:
        if self.followers is not None:   # checked here too: without followers, no message is built
            self._tell_followers(Step(bucket.num_decode, bucket.num_segments,
                                      self._step_arrays.send(jax.tree.leaves(batch)), bucket.decode_len,
                                      self.model_index, to_logits))

    def _run_step(self, batch: StepInput, bucket: Bucket):
        """The whole step: (samples, prompt logprobs), on the device."""
        self._send_step(batch, bucket)
        if not self._fused:
            logits, prompt = self._logits(batch)
            return self._run_sampling(logits, batch.sampling), prompt
        samples, prompt, self.kv_pages, self._sampled = self._step(self.model.params, self.kv_pages, self._sampled,
                                                                   self.lora, self._place(batch), score=_scores(batch))
        return samples, prompt

    def _allocate_lora(self, num_slots: int, rank: int):
        mesh = self.model.mesh
        place = None if mesh is None else (lambda path, shape: sharding_for(mesh, path, shape))
        return lora.allocate(lora_shapes(self.model.config), self.model.config.num_layers, num_slots, rank,
                             self.model.dtype, place)

    def load_lora(self, slot: int, modules: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Writes an adapter's weights (`LoraAdapter.modules`, as the checkpoint has them) into
        `slot` in place; on a mesh whose heads were rearranged, the adapter's are too."""
        cfg = self.model.config
        if self.model.mesh is not None:
            modules = pad_lora_heads(ModelConfig.from_hf(self.model.hf_config), modules, self.model.mesh.shape["model"])
        rank = self.lora["q_proj"][0].shape[-1]
        arrays = lora.padded(modules, lora_shapes(cfg), cfg.num_layers, rank)
        if self.followers is not None:
            self._tell_followers(LoadLora(slot, tuple(Array.of(x) for pair in arrays.values() for x in pair)))
        self.lora = lora.load_slot(self.lora, slot, arrays)

    def _new_sampled(self) -> Sampled:
        """Zeros, placed as the pool is (uncommitted without a mesh: a committed argument would
        commit the step's outputs, and the pool would no longer match the programs compiled),
        replicated on a mesh."""
        sampled = Sampled(np.zeros(self._num_rows, np.int32),
                          np.zeros((self._num_rows, self.layout.vocab_size), np.int32))
        if self.model.mesh is None:
            return jax.tree.map(jax.numpy.asarray, sampled)
        return place(sampled, NamedSharding(self.model.mesh, jax.sharding.PartitionSpec()))

    def _copy(self, source: np.ndarray, destination: np.ndarray) -> None:
        if self.followers is not None:
            self._tell_followers(CopyPages(Array.of(source), Array.of(destination), self.model_index))
        self.kv_pages = self._copy_pages(self.kv_pages, source, destination)

    def _place(self, batch):
        """With a mesh, the step's arrays (or its sampling's) split over its data slices."""
        return batch if self._batch_sharding is None else place(batch, self._batch_sharding)

    def _make_copies(self, copies: tuple[tuple[int, int], ...]) -> None:
        for start in range(0, len(copies), self.max_copies):
            pairs = np.zeros((self.max_copies, 2), np.int32)   # padding copies page 0 onto itself
            chunk = copies[start:start + self.max_copies]
            pairs[:len(chunk)] = chunk
            self._copy(pairs[:, 0], pairs[:, 1])

    def logits(self, output: SchedulerOutput) -> dict[str, np.ndarray]:
        """Runs one step and returns, instead of tokens, the logits of each sampling sequence."""
        self._make_copies(output.page_copies)
        batch, rows = self.layout.build(output, self.bucket_for(output), self.num_slices)
        logits, self.kv_pages = self._forward(self.model.params, self.kv_pages, self.lora, self._place(batch))
        logits = np.asarray(logits)
        return {seq.request_id: logits[i] for i, seq in enumerate(rows) if seq}

    def prompt_logits(self, token_ids: list[int], chunk: int) -> Iterator[np.ndarray]:
        """Teacher-forced logits of a whole text, `chunk` tokens a step through pages 1, 2, ... of
        the pool (which must hold it): yields [tokens of the chunk, vocab] float32 per step; row i
        predicts token i + 1. For accuracy and perplexity measurements."""
        pages = -(-len(token_ids) // self.layout.page_size)
        table = tuple(range(1, pages + 1))
        for start in range(0, len(token_ids), chunk):
            part = tuple(token_ids[start:start + chunk])
            seq = ScheduledSequence("text", part, start, table, True, SamplingParams(temperature=0), 0, 0)
            output = SchedulerOutput((seq,))
            bucket = self.bucket_for(output)
            batch, _ = self.layout.build(output, bucket, self.num_slices)
            first = bucket.num_decode if len(part) > 1 else 0   # a 1-token chunk is a decode row
            batch = batch.replace(logits_index=np.arange(first, first + len(part), dtype=np.int32))
            logits, self.kv_pages = self._forward(self.model.params, self.kv_pages, self.lora, self._place(batch))
            yield np.asarray(logits)

    def release_penalty_slots(self, request_ids: Iterable[str]) -> None:
        """The next penalised rows of these sequences fill their slots anew from their histories
        (a draft model's slots have counted proposals that the target may have rejected)."""
        for request_id in request_ids:
            self._penalty_slots.release(request_id)

    def pool_is_lost(self) -> bool:
        """True when a failed step consumed the donated pool."""
        return any(x.is_deleted() for x in jax.tree.leaves(self.kv_pages))

    def reset_pool(self) -> None:
        """A new, empty pool (and no placeholders to read, no penalty counts) after a failed step
        lost the old one."""
        self._tell_followers(ResetPool(self.model_index))
        self._sampled, self._sampled_rows = self._new_sampled(), {}
        self._penalty_slots = PenaltySlots(self._num_rows)
        k = self.kv_pages.k
        self.kv_pages = kv_pool.allocate(self.model.config, k.shape[2] // self.num_slices, k.shape[3],
                                         self.kv_dtype, self.model.mesh)
