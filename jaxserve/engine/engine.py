"""`LLMEngine`: requests in, one step at a time, outputs back.

`step()` is the whole loop: the scheduler picks a step's sequences and token counts, the
constrained ones get their allowed-token masks, the runner launches it on the device; then the
step before is read back: the scheduler advances its requests and frees the pages of finished
ones, the constrained samples' grammars take their tokens, and each sample's text is extended
(stop strings applied).

Async scheduling (vLLM's `--async-scheduling`, on by default): step N+1 is scheduled and launched
before step N is read back, so the device runs N+1 while the host does N's bookkeeping. Each
sequence N samples for counts as a placeholder, whose id step N+1 reads on the device. A request
that N ends (EOS, a stop id or string, a grammar's end) has one more token computed in N+1, and
dropped; one that N's token ends by length is not scheduled again. A constrained sequence's
grammar fills its mask from its last token on the host: a step N+1 that samples for one is
launched up to its logits, and sampled with the masks once N is read back (followers replay
both halves). While few enough requests run to speculate,
steps are serial too: drafts are proposed from the last token.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import time
from collections.abc import Callable

import numpy as np

from jaxserve.checkpoint.loader import LoadedModel, load_model
from jaxserve.checkpoint.peft import LoraAdapter, read_adapter
from jaxserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from jaxserve.device_calls import DeviceCall
from jaxserve.engine import kv_pages as kv_pool
from jaxserve.engine.output import CompletionOutput, RequestMetrics, RequestOutput, SampleText, TokenLogprob
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.request import FinishReason, Request
from jaxserve.engine.data_slices import SlicedScheduler
from jaxserve.engine.draft_model import DraftModelProposer, check_draft
from jaxserve.engine.lora_adapters import LoraAdapters
from jaxserve.engine.memory_budget import PoolBudget, device_memory, pool_budget
from jaxserve.engine.ngram_proposer import NgramProposer
from jaxserve.engine.runner import Followers, LaunchedStep, Runner, speculative_buckets
from jaxserve.engine.sampler import row_seed
from jaxserve.engine.structured_output import ConstrainedProposals, Grammars, pack_tokens, within_allowed
from jaxserve.engine.scheduler import Proposer, SchedulerConfig
from jaxserve.engine.scheduler_output import SchedulerOutput
from jaxserve.errors import InvalidRequestError
from jaxserve.host_memory import collector_paused, keep_freed_memory
from jaxserve.lora_request import LoRARequest
from jaxserve.sharding import mesh_from_config
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)

NON_FINITE = ("the model's logits were not finite (NaN or inf) for this request: it is failed, the other "
              "requests of the step go on")


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The scheduler's state; sequences, not requests (a request with n samples counts n)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0     # fraction of usable KV pages in use
    num_preemptions: int = 0        # since start: sequences preempted (and later recomputed)
    prefix_cache_queries: int = 0   # since start: prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0      # since start: of those, tokens found cached (not computed)
    spec_decode_num_drafts: int = 0            # since start: sequences given speculative drafts
    spec_decode_num_draft_tokens: int = 0      # since start: drafts proposed
    spec_decode_num_accepted_tokens: int = 0   # since start: drafts confirmed by the target's samples
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()   # [i]: drafts confirmed at position i
    running_lora_adapters: tuple[str, ...] = ()   # names of the LoRA adapters of running sequences
    waiting_lora_adapters: tuple[str, ...] = ()   # ... and of waiting ones (not running)
    max_lora: int = 0                             # LoRA slots on the device (0: LoRA off)


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Where one step's host time went, in seconds (`LLMEngine.step_observer`). Under async
    scheduling the device runs the step before (schedule, masks, prepare, launch) or the step after
    (update, outputs) meanwhile; `device` is the time the host waited for this step's tokens."""

    kind: str          # "decode" (every sequence computes one token), "prefill" (none does), "mixed"
    num_seqs: int
    num_tokens: int
    schedule: float    # Scheduler.schedule
    masks: float       # the constrained sequences' allowed-token masks (structured outputs)
    prepare: float     # page copies launched, the step's host arrays built
    launch: float      # its arrays sent and its program called (Runner.launch's device calls; on a CPU
                       # mostly XLA:CPU's own time before the call returns: README, "bench_host")
    device: float      # waiting for its tokens to come back
    update: float      # its tokens read into Python (Runner.collect), then Scheduler.update: requests
                       # advanced, pages cached and freed
    outputs: float     # detokenising, stop strings, RequestOutputs

    @property
    def host(self) -> float:
        return self.schedule + self.masks + self.prepare + self.launch + self.update + self.outputs


@dataclasses.dataclass(frozen=True)
class _Launched:
    """A step scheduled and launched (or failed to launch), not read back yet."""

    output: SchedulerOutput
    step: LaunchedStep | None
    error: Exception | None
    schedule_s: float
    masks_s: float


def _step_kind(output: SchedulerOutput) -> str:
    single = sum(s.num_tokens == 1 for s in output.sequences)
    return "decode" if single == len(output.sequences) else "prefill" if single == 0 else "mixed"


@dataclasses.dataclass
class _Group:
    """A client request: its prompt and its samples (one `Request` each: n, or best_of)."""

    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    texts: list[SampleText]
    error: str | None = None
    error_param: str | None = None   # set when the request itself caused `error` (see RequestOutput)
    first_token_time: float | None = None   # monotonic
    logprobs: list[list[TokenLogprob]] = dataclasses.field(init=False)   # per sample, per token
    # per sample, `logprobs`' sum, added to as they come: summed anew for each output, 256 delta
    # streams asking for logprobs took 42 ms a step on outputs by their 448th token (now 7.5)
    cumulative_logprobs: list[float] = dataclasses.field(init=False)
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)   # [i]: of prompt token i + 1
    sent: list[tuple[int, int]] = dataclasses.field(init=False)   # DELTA: per sample, (tokens, characters) sent
    has_output: bool = False   # an output was made (DELTA sends the prompt's logprobs in the first only)
    # Whether it has an output at every step it moves. Not with best_of > n, where which samples
    # are returned is known only at the end, nor when it asks for the final one only.
    streams: bool = dataclasses.field(init=False)
    # Whether a step that moves it without ending it has nothing to do for it (one sample, its final
    # output only, no stop strings, logprobs or grammar): most of a large batch. Walking such a
    # request's tokens took 3-4 us of a step's outputs (256 sequences).
    quiet: bool = dataclasses.field(init=False)
    # Its metrics once it has a first token, when they no longer change: made anew for each output
    # they took 1.3 us, a fifth of a streamed output's making (256 streams a step).
    _metrics: RequestMetrics | None = dataclasses.field(default=None, init=False)

    def __post_init__(self):
        self.logprobs = [[] for _ in self.samples]
        self.cumulative_logprobs = [0.0] * len(self.samples)
        self.sent = [(0, 0)] * len(self.samples)
        params = self.samples[0].params
        self.streams = params.streams
        self.quiet = (len(self.samples) == 1 and not self.streams and not params.stop and params.logprobs is None
                      and params.structured_outputs is None)

    @property
    def finished(self) -> bool:
        samples = self.samples
        if len(samples) == 1:   # the usual request: no generator (0.84 us against 0.22-0.28)
            return samples[0].is_finished
        return all(s.is_finished for s in samples)

    def output(self, request_id: str) -> RequestOutput:
        params = self.samples[0].params
        delta = params.output_kind == RequestOutputKind.DELTA
        finished = self.finished
        outputs = [self._sample_output(i, delta) for i in range(len(self.samples))]
        if params.num_samples != params.n:
            best = sorted(outputs, key=_likelihood, reverse=True)[:params.n] if finished else []
            outputs = [dataclasses.replace(o, index=i) for i, o in enumerate(best)]
        prompt_logprobs = None
        if params.prompt_logprobs is not None and not (delta and self.has_output):   # vLLM's shape: the first
            prompt_logprobs = [None, *self.prompt_logprobs]                          # token has none
        self.has_output = True
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, outputs, finished, self.error,
                             self.metrics(), self.samples[0].num_cached_tokens, prompt_logprobs, self.error_param)

    def metrics(self) -> RequestMetrics:
        """Final once the first token is sampled: the first sample was scheduled by then, and a
        sample scheduled later (a fork readmitted after a preemption) cannot lower the minimum."""
        if self._metrics is not None:
            return self._metrics
        scheduled = [s.first_scheduled_time for s in self.samples if s.first_scheduled_time is not None]
        metrics = RequestMetrics(self.samples[0].arrival_time, min(scheduled, default=None), self.first_token_time)
        if self.first_token_time is not None:
            self._metrics = metrics
        return metrics

    def _sample_output(self, i: int, delta: bool) -> CompletionOutput:
        """Sample i's output: all of it, or with `delta` what it has not sent yet."""
        sample, logprobs, text = self.samples[i], self.logprobs[i], self.texts[i].text
        reason = sample.finish_reason.value if sample.finish_reason else None
        computed = len(logprobs) == len(sample.output_token_ids) and sample.output_token_ids
        tokens, characters = self.sent[i] if delta else (0, 0)
        if delta:
            self.sent[i] = len(sample.output_token_ids), len(text)
        return CompletionOutput(
            i, text[characters:], sample.output_token_ids[tokens:], reason,
            logprobs=logprobs[tokens:] if sample.params.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprobs[i] if computed else None)


def _likelihood(output: CompletionOutput) -> float:
    return -math.inf if output.cumulative_logprob is None else output.cumulative_logprob


class LLMEngine:
    def __init__(self, config: EngineConfig, model: LoadedModel | None = None,
                 progress: Callable[[int, int], None] | None = None, followers: Followers | None = None):
        self.config = config
        keep_freed_memory()  # XLA's step buffers stay mapped between steps (see host_memory)
        self.model = model or load_model(config.model, config.dtype, mesh_from_config(config.mesh),
                                           config.quantization)
        self.tokenizer = self.model.tokenizer
        self.max_model_len = self._max_model_len()
        num_slices = kv_pool.num_data_slices(self.model.mesh)
        kv_dtype = kv_pool.resolve_kv_dtype(config.kv_cache_dtype, self.model.dtype)
        spec = config.speculative_config
        self.runner = Runner(self.model, None, config.page_size, self.max_model_len, config.max_num_seqs,
                             config.max_num_batched_tokens, config.prefill_segment,
                             attention_backend=config.attention_backend, followers=followers,
                             kv_cache_dtype=config.kv_cache_dtype, speculative_buckets=speculative_buckets(
                                 min(spec.disable_by_batch_size, config.max_num_seqs), spec.num_speculative_tokens,
                                 config.max_num_batched_tokens, config.prefill_segment) if spec else [],
                             max_loras=config.max_loras if config.enable_lora else 0,
                             max_lora_rank=config.max_lora_rank)
        self.lora_adapters = LoraAdapters(
            config.max_loras, config.max_cpu_loras, self.read_adapter,
            lambda slot, adapter: self.runner.load_lora(slot, adapter.modules)) if config.enable_lora else None
        draft = self._load_draft(spec)
        draft_bytes = kv_pool.bytes_per_page(draft.config, config.page_size, kv_dtype) if draft else 0
        window = self._window_of_every_layer(draft)
        pages, source = kv_pool.num_pages(config, self.model.config, kv_dtype, self.max_model_len, num_slices,
                                          self._memory_budget(), extra_bytes_per_page=draft_bytes, window=window)
        self.runner.allocate_pool(pages)
        self.proposer = self._proposer(spec, draft, pages, followers)
        self._matchers: dict = {}   # sample id -> its grammar's matcher (structured outputs)
        self._allowed: dict[str, np.ndarray] = {}   # sample id -> packed mask of its allowed_token_ids
        self.eos_token_ids = self._eos_token_ids()
        self.grammars = Grammars(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids,
                                 config.max_structured_output_bytes)
        self.allocators = [PageAllocator(pages, config.page_size, config.enable_prefix_caching)
                           for _ in range(num_slices)]
        self.scheduler = SlicedScheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.prefill_segment,
                            config.enable_chunked_prefill, config.scheduling_policy,
                            config.priority_max_wait_steps, spec, config.max_loras if config.enable_lora else 0,
                            window),
            self.allocators,
            ConstrainedProposals(self.proposer, self._matchers, self._allowed, self.grammars)
            if self.proposer else None)
        self._groups: dict[str, _Group] = {}
        self._seeds = random.Random(config.seed)
        self._ids = itertools.count()
        self.step_observer: Callable[[StepTimes], None] | None = None   # told each step's StepTimes
        # Told, once per step read back, {request id: (prompt tokens, output tokens so far)} of the
        # requests that moved without an output (final-only, best_of): a server's latency metrics
        # see each of their steps without an output built for it.
        self.progress_observer: Callable[[dict[str, tuple[int, int]]], None] | None = None
        self._in_flight: _Launched | None = None   # async scheduling: the step launched, not read back
        log.info("KV pool: %d x %d pages of %d tokens = %d tokens (%.2f GiB, %s), from %s", num_slices, pages - 1,
                 config.page_size, num_slices * (pages - 1) * config.page_size, num_slices * pages
                 * (kv_pool.bytes_per_page(self.model.config, config.page_size, kv_dtype) + draft_bytes) / 2**30,
                 kv_dtype.name + (" with the draft model's pages" if draft else ""), source)
        if spec:
            log.info("speculative decoding: %s", spec)
        if config.enable_lora:
            log.info("LoRA: %d device slots of rank %d (%.1f MiB), %d adapters kept in host memory", config.max_loras,
                     config.max_lora_rank, self.runner.lora_bytes / 2**20,
                     config.max_cpu_loras)
        if config.enforce_eager:
            log.info("enforce_eager: each step shape compiles when a step first needs it")
        else:   # several processes run every step together: they compile all of them first
            with collector_paused():   # tracing makes objects that live on (see host_memory)
                self._warm_up(progress, background=config.compile_in_background and followers is None)

    def _warm_up(self, progress: Callable[[int, int], None] | None, background: bool) -> None:
        started = time.perf_counter()
        self.runner.warm_up(progress, background=background)
        drafts = 0
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.runner.warm_up()
            drafts = len(self.proposer.runner.buckets)
        compiled = len(self.runner.ready_buckets)
        log.info("compiled %d step shapes in %.1f s%s", compiled + drafts, time.perf_counter() - started,
                 f"; {len(self.runner.buckets) - compiled} more compile in the background"
                 if compiled < len(self.runner.buckets) else "")

    def _window_of_every_layer(self, draft: LoadedModel | None) -> int | None:
        """The window all layers attend within (Mistral, Phi-3), behind which pages are released;
        None where a layer sees the whole context (Gemma's global layers), or a draft model, which
        reads the same block tables, might."""
        model = self.model.config
        if draft is not None or not model.sliding_window or not all(model.sliding_layers or (True,)):
            return None
        return model.sliding_window

    def _load_draft(self, spec: SpeculativeConfig | None) -> LoadedModel | None:
        """The draft model of method draft_model, in the target's dtype and on its mesh, checked."""
        if spec is None or spec.method != "draft_model":
            return None
        draft = load_model(spec.model, self.config.dtype, self.model.mesh)
        check_draft(draft, self.model, self.max_model_len)
        log.info("draft model %s: %.1f MiB of weights", draft.path, draft.weight_bytes / 2**20)
        return draft

    def _proposer(self, spec: SpeculativeConfig | None, draft: LoadedModel | None, pages: int,
                  followers: Followers | None) -> Proposer | None:
        if spec is None:
            return None
        if draft is None:
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        config, max_num_seqs = self.config, min(spec.disable_by_batch_size, self.config.max_num_seqs)
        runner = Runner(draft, pages, config.page_size, self.max_model_len, max_num_seqs,
                        config.max_num_batched_tokens, config.prefill_segment,
                        attention_backend=config.attention_backend, followers=followers,
                        kv_cache_dtype=config.kv_cache_dtype, model_index=1)
        return DraftModelProposer(runner, max_num_seqs, config.max_num_batched_tokens, config.prefill_segment)

    def replay(self, call: DeviceCall) -> None:
        """A follower process makes a device call of process 0's target or draft model runner."""
        runner = self.proposer.runner if getattr(call, "model", 0) == 1 and isinstance(
            self.proposer, DraftModelProposer) else self.runner
        runner.replay(call)

    def _memory_budget(self) -> PoolBudget | None:
        """What the devices have left for the pool, after the weights and the largest step, when no
        flag sizes the pool (see memory_budget)."""
        devices = self.runner.devices()
        if not kv_pool.sized_by_budget(self.config, devices[0].platform):
            return None
        step_bytes = self.runner.step_bytes()
        return pool_budget(device_memory(devices), kv_pool.utilization(self.config), step_bytes)

    def _max_model_len(self) -> int:
        limit = self.model.config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's context length {limit}")
        return wanted

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, lora_request: LoRARequest | None = None) -> str:
        """Queues a prompt (text or token ids); returns its id. Raises InvalidRequestError.
        `priority`: lower runs sooner under the priority scheduling policy; `lora_request`: the
        LoRA adapter it runs with (--enable-lora)."""
        params = params or SamplingParams()
        lora_id = self.add_lora(lora_request) if lora_request is not None else 0
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._groups:
            raise InvalidRequestError("request_id", f"request_id={request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        text, token_ids = self._truncate(text, token_ids, params.truncate_prompt_tokens)
        max_tokens = self._check_lengths(len(token_ids), params)
        self._check_sampling(params)
        constraint = params.structured_outputs
        grammar = self.grammars.grammar(constraint) if constraint is not None else None
        base_seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        num_samples = params.num_samples
        samples = [
            Request(request_id=f"{request_id}/{i}", prompt_token_ids=list(token_ids), params=params,
                    seed=base_seed if num_samples == 1 else row_seed(base_seed, -1 - i),
                    max_total_tokens=len(token_ids) + max_tokens, eos_token_ids=self.eos_token_ids,
                    priority=priority, lora_id=lora_id)
            for i in range(num_samples)]
        texts = [SampleText(self.tokenizer, params.stop, params.skip_special_tokens, s.output_token_ids)
                 for s in samples]
        self.scheduler.add(samples[0], forks=samples[1:])
        self._groups[request_id] = _Group(text, list(token_ids), samples, texts)
        if grammar is not None:
            self._matchers.update((s.request_id, self.grammars.matcher(grammar)) for s in samples)
        if params.allowed_token_ids is not None:
            allowed = pack_tokens(params.allowed_token_ids, self.model.config.vocab_size)
            self._allowed.update((s.request_id, allowed) for s in samples)
        return request_id

    def add_lora(self, lora_request: LoRARequest) -> int:
        """Reads and checks an adapter (unless known) so that requests can name it; its id.
        Raises InvalidRequestError naming the adapter and what is wrong with it."""
        if self.lora_adapters is None:
            raise InvalidRequestError("model", f"LoRA adapter {lora_request.lora_name!r}: this engine serves no "
                                               f"adapters; start it with --enable-lora")
        try:
            return self.lora_adapters.register(lora_request)
        except ValueError as error:
            raise InvalidRequestError("lora_path", f"lora_name={lora_request.lora_name!r}: {error}") from None

    def remove_lora(self, lora_id: int) -> None:
        """Forgets an adapter; refused while requests run or wait with it."""
        in_use = sum(1 for g in self._groups.values() for s in g.samples if s.lora_id == lora_id)
        if in_use:
            raise InvalidRequestError("lora_name", f"LoRA adapter {self.lora_adapters.name(lora_id)!r} has {in_use} "
                                                   f"sequence(s) in flight; unload it when they are done")
        self.lora_adapters.forget(lora_id)

    def read_adapter(self, path: str) -> LoraAdapter:
        """The PEFT adapter at `path`, read and checked against this model and max_lora_rank."""
        return read_adapter(path, ModelConfig.from_hf(self.model.hf_config), self.config.max_lora_rank)

    def _truncate(self, text: str | None, token_ids: list[int], keep: int | None) -> tuple[str | None, list[int]]:
        """truncate_prompt_tokens: only the prompt's last `keep` tokens (-1: max_model_len's worth)."""
        if keep is None:
            return text, token_ids
        if keep > self.max_model_len:
            raise InvalidRequestError("truncate_prompt_tokens", f"truncate_prompt_tokens={keep} exceeds "
                                                                f"max_model_len={self.max_model_len}")
        keep = self.max_model_len if keep == -1 else keep
        if len(token_ids) <= keep:
            return text, token_ids
        return None, token_ids[-keep:]

    def _check_sampling(self, params: SamplingParams) -> None:
        if params.num_samples > self.config.max_num_seqs:
            name = "best_of" if params.best_of else "n"
            raise InvalidRequestError(name, f"{name}={params.num_samples} exceeds max_num_seqs="
                                            f"{self.config.max_num_seqs}, the most samples one step can hold")
        vocab = self.model.config.vocab_size
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(name, f"token id {bad[0]} in {name} is outside the vocabulary [0, {vocab})")

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            text = prompt
        else:
            token_ids, text = [int(t) for t in prompt], None
            bad = [t for t in token_ids if not 0 <= t < self.model.config.vocab_size]
            if bad:
                raise InvalidRequestError("prompt", f"token id {bad[0]} is outside the vocabulary "
                                                    f"[0, {self.model.config.vocab_size})")
        if not token_ids:
            raise InvalidRequestError("prompt", "the prompt is empty: give at least one token")
        return text, token_ids

    def _check_lengths(self, prompt_len: int, params: SamplingParams) -> int:
        """The request's max_tokens, after checking it fits the context."""
        if prompt_len >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {prompt_len} tokens, but max_model_len is {self.max_model_len} "
                          f"(prompt + at least one output token must fit)")
        room = self.max_model_len - prompt_len
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                "max_tokens", f"max_tokens={params.max_tokens} plus the prompt's {prompt_len} tokens exceeds "
                              f"max_model_len={self.max_model_len}; at most {room} new tokens fit")
        return params.max_tokens or room

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancels a request; its pages go back to the pool at once."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for sample, text in zip(group.samples, group.texts):
            self._forget_masks(sample.request_id)
            if not sample.is_finished:
                self.scheduler.abort(sample.request_id)
                text.finish()
        return group.output(request_id)

    def stats(self) -> EngineStats:
        counters = self.scheduler.counters
        return EngineStats(len(self.scheduler.running), self.scheduler.num_waiting,
                           self.scheduler.kv_cache_usage(), counters.num_preemptions,
                           counters.prefix_cache_queries, counters.prefix_cache_hits,
                           counters.spec_decode_num_drafts, counters.spec_decode_num_draft_tokens,
                           counters.spec_decode_num_accepted_tokens,
                           tuple(counters.spec_decode_num_accepted_tokens_per_pos), *self._lora_stats())

    def _lora_stats(self) -> tuple[tuple[str, ...], tuple[str, ...], int]:
        if self.lora_adapters is None:
            return (), (), 0
        running = {r.lora_id for r in self.scheduler.running}
        waiting = {s.lora_id for g in self._groups.values() for s in g.samples if not s.is_finished} - running
        names = lambda ids: tuple(sorted(self.lora_adapters.name(i) for i in ids if i))   # noqa: E731
        return names(running), names(waiting), self.lora_adapters.max_loras

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ---- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Reads one step back (launching it first if none is in flight), after launching the next
        one under async scheduling; outputs of the requests that moved forward."""
        current, self._in_flight = self._in_flight or self._launch(ahead=False), None
        if current is None:
            return []
        if current.error is None and self._schedules_ahead():   # a failed launch sampled nothing to read
            self._in_flight = self._launch(ahead=True)
        results = self._read_back(current)
        if self._in_flight is not None:
            self._in_flight = self._sample_with_masks(self._in_flight)
        return results + self._drain_if_idle()

    def _drain_if_idle(self) -> list[RequestOutput]:
        """Reads back the step in flight when every request it computes for has ended, so that an
        idle engine holds no step and the next request's first step is its own."""
        if self._in_flight is None or self._groups:
            return []
        leftover, self._in_flight = self._in_flight, None
        return self._read_back(leftover)

    def _schedules_ahead(self) -> bool:
        """Whether the next step may be scheduled before the current one is read back: not while
        few enough run to speculate (drafts are proposed from the last token). Penalties read the
        last token on the device (sampler.PLACEHOLDER); a grammar's mask is filled after the
        launch (`_sample_with_masks`)."""
        spec = self.config.speculative_config
        return self.config.async_scheduling and not (spec and len(self.scheduler.running) <= spec.disable_by_batch_size)

    def _launch(self, ahead: bool) -> _Launched | None:
        """Schedules and launches a step. `ahead`: the step before is not read back yet, so the
        grammars of the sequences it samples for have not taken their tokens: a step that samples
        for a constrained sequence stops at its logits, and `_sample_with_masks` finishes it."""
        started = time.perf_counter()
        output = self.scheduler.schedule()
        if output.is_empty:
            return None
        scheduled = time.perf_counter()
        masks_later = ahead and bool(self._matchers) and any(s.samples and s.request_id in self._matchers
                                                             for s in output.sequences)
        if not masks_later:
            output = self._with_token_masks(output)
        masked = time.perf_counter()
        if self.lora_adapters is not None:
            slots = self.lora_adapters.slots_for(s.lora_id for s in output.sequences)
            output = dataclasses.replace(output, lora_slots={s.request_id: slots.get(s.lora_id, 0)
                                                             for s in output.sequences})
        try:
            step, error = self.runner.launch(output, masks_later), None
        except Exception as failure:  # noqa: BLE001 - one bad step must not take the engine down
            step, error = None, failure
        return _Launched(output, step, error, scheduled - started, masked - scheduled)

    def _sample_with_masks(self, launched: _Launched) -> _Launched:
        """A step launched at its logits (`_launch`), sampled now that the step before is read
        back: each constrained sequence's grammar has its last token, or has ended (the sequence's
        row is then sampled unconstrained, and dropped)."""
        if launched.step is None or not launched.step.waits_for_masks:
            return launched
        started = time.perf_counter()
        output = self._with_token_masks(launched.output)
        masks_s = launched.masks_s + time.perf_counter() - started
        try:
            return dataclasses.replace(launched, step=self.runner.sample(launched.step, output.token_masks or {}),
                                       masks_s=masks_s)
        except Exception as failure:  # noqa: BLE001 - one bad step must not take the engine down
            return dataclasses.replace(launched, step=None, error=failure)

    def _read_back(self, launched: _Launched) -> list[RequestOutput]:
        output = launched.output
        if launched.error is not None:
            return self._fail_step(output, launched.error)
        waiting = time.perf_counter()
        try:
            result = self.runner.collect(launched.step)
        except Exception as error:  # noqa: BLE001 - one bad step must not take the engine down
            return self._fail_step(output, error)
        sampled, logprobs, non_finite = result.tokens, result.logprobs, result.non_finite
        self._take_prompt_logprobs(result.prompt_logprobs)
        # Before update: their chunk's pages must not reach the prefix cache.
        results = self._fail_requests(non_finite, NON_FINITE) if non_finite else []
        advanced = self.scheduler.update(output, sampled)
        updated = time.perf_counter()
        results += self._outputs({r.request_id: run for r, run in advanced.items()}, logprobs)
        if self.step_observer is not None:
            step = launched.step
            self.step_observer(StepTimes(
                _step_kind(output), len(output.sequences), sum(s.num_tokens for s in output.sequences),
                launched.schedule_s, launched.masks_s, step.prepare_s, step.launch_s, result.wait_s,
                updated - waiting - result.wait_s, time.perf_counter() - updated))
        return results

    def _take_prompt_logprobs(self, found: dict[str, list[tuple[int, TokenLogprob]]]) -> None:
        """Appends each prompt position's logprob to its request; a preempted request computes its
        prompt again from position 0, and the positions it already has are skipped."""
        for sample_id, entries in found.items():
            group = self._groups.get(sample_id.rpartition("/")[0])
            if group is None:
                continue
            for position, entry in entries:
                if position == len(group.prompt_logprobs):
                    group.prompt_logprobs.append(entry)

    def _with_token_masks(self, output: SchedulerOutput) -> SchedulerOutput:
        """The step with the allowed-token mask of each sequence that samples in it under a grammar
        (structured outputs) or allowed_token_ids, or both (then a token must pass both)."""
        if not self._matchers and not self._allowed:
            return output
        sampling = [s for s in output.sequences if s.samples]
        constrained = [s for s in sampling if s.request_id in self._matchers]
        masks = {}
        if constrained:   # a sequence with drafts: a mask per sampling row (sampler.allowed_rows)
            filled = self.grammars.fill_masks([self._matchers[s.request_id] for s in constrained],
                                              [s.draft_token_ids for s in constrained])
            masks = {s.request_id: rows if s.draft_token_ids else rows[0] for s, rows in zip(constrained, filled)}
        masks = within_allowed(masks, self._allowed, [s.request_id for s in sampling])
        return dataclasses.replace(output, token_masks=masks) if masks else output

    def _constrain(self, sample: Request, token: int) -> str | None:
        """Moves a constrained sample's grammar past its new token, unless the grammar is complete
        already: finishes the sample (stop) when the token completes it; returns an error message
        when the token does not fit (the grammar allowed no token the sampler could take). Every
        token of a run goes in, even when the scheduler ended the sample at the run's last one, so
        that a grammar complete before it is seen (`_outputs` drops the tokens after)."""
        matcher = self._matchers.get(sample.request_id)
        if matcher is None or matcher.is_stopped():
            return None
        if not matcher.consume_token(token):
            return (f"structured output: the constraint allows no continuation after "
                    f"{len(sample.output_token_ids) - 1} tokens ({matcher.get_error() or f'token {token} rejected'})")
        if matcher.is_stopped():
            self.scheduler.abort(sample.request_id, FinishReason.STOP)
        return None

    def _grammar_complete(self, sample: Request) -> bool:
        matcher = self._matchers.get(sample.request_id)
        return matcher is not None and matcher.is_stopped()

    def _outputs(self, received: dict[str, tuple[int, ...]],
                 logprobs: dict[str, tuple[TokenLogprob, ...]]) -> list[RequestOutput]:
        """Each sample's new tokens (several after confirmed drafts) through its grammar and text, in
        order; a stop string ends the sample at the token that completes it, and drops the rest."""
        results, progress, constrained = [], {}, bool(self._matchers)
        for request_id, group in list(self._groups.items()):
            if group.quiet and group.first_token_time is not None:
                sample = group.samples[0]
                if sample.request_id not in received:
                    continue
                if not sample.is_finished:   # its text reads the tokens when it finishes
                    if self.progress_observer is not None:
                        progress[request_id] = len(group.prompt_token_ids), len(sample.output_token_ids)
                    continue
            touched, ended, streams = False, False, group.streams
            for k, (sample, text, sample_logprobs) in enumerate(zip(group.samples, group.texts, group.logprobs)):
                run = received.get(sample.request_id)
                if run is None:
                    continue
                touched = True
                run_logprobs = logprobs.get(sample.request_id) if logprobs else None
                try:
                    for i, token in enumerate(run):
                        if run_logprobs is not None:
                            entry = run_logprobs[i]
                            sample_logprobs.append(entry)
                            group.cumulative_logprobs[k] += entry.logprob
                        dead_end = constrained and self._constrain(sample, token)
                        if dead_end and not group.error:   # the request's own constraint led there
                            group.error, group.error_param = dead_end, "structured_outputs"
                        # a stop string, or a grammar complete before the run's last token (drafts)
                        if text.add(token) or (constrained and i < len(run) - 1
                                               and self._grammar_complete(sample)):
                            self._stop_at(sample, len(run) - 1 - i)
                            break
                    if sample.is_finished:
                        ended = True
                        text.finish()
                        self._forget_masks(sample.request_id)
                    elif streams:   # its output is made now: a tokenizer's failure fails it here
                        text.catch_up()
                except Exception as error:  # noqa: BLE001 - a tokenizer failing on one request fails it alone
                    log.exception("output of request %s failed", request_id)
                    group.error = f"making the output failed: {type(error).__name__}: {error}"
            if touched and group.first_token_time is None:
                group.first_token_time = time.monotonic()
            if group.error:
                self._fail_group(group)
                ended = True
            # A group ends when the last of its samples does, so only a step that ended one can end it.
            if touched and (streams or ended and group.finished):
                results.append(group.output(request_id))
                if group.finished:
                    del self._groups[request_id]
            elif touched and self.progress_observer is not None:
                progress[request_id] = (len(group.prompt_token_ids),
                                        sum(len(s.output_token_ids) for s in group.samples))
        if progress:
            self.progress_observer(progress)
        return results

    def _stop_at(self, sample: Request, num_after: int) -> None:
        """A stop string ends `sample` at a token with `num_after` tokens of its run after it: they
        are dropped. (One that ends at the run's last token keeps a finish the scheduler gave it.)"""
        if self.scheduler.abort(sample.request_id, FinishReason.STOP) is None and num_after:
            sample.finish(FinishReason.STOP)   # the scheduler ended it later in the run
        sample.drop_last_outputs(num_after)

    def _fail_group(self, group: _Group) -> None:
        """Ends every sample of a request whose `error` is set; their pages return to the pool."""
        for sample, text in zip(group.samples, group.texts):
            self._forget_masks(sample.request_id)
            self.scheduler.abort(sample.request_id, FinishReason.ERROR)
            try:
                text.catch_up()
            except Exception:  # noqa: BLE001 - it fails already; its text stays as far as it got
                pass

    def _forget_masks(self, sample_id: str) -> None:
        self._matchers.pop(sample_id, None)
        self._allowed.pop(sample_id, None)

    def _fail_step(self, output, error: Exception) -> list[RequestOutput]:
        """Fails the requests of a step that raised (all running ones if the pool was lost)."""
        log.exception("engine step failed: %s", error)
        failed = {s.request_id for s in output.sequences}
        pool_lost = self.runner.pool_is_lost()
        if pool_lost:   # every running request's K/V is gone, and a step in flight read the lost pool
            failed |= {r.request_id for r in self.scheduler.running}
            self._in_flight = None
            self.runner.reset_pool()
        results = self._fail_requests(failed, f"engine step failed: {type(error).__name__}: {error}")
        if pool_lost:
            self.scheduler.clear_cache()   # after the failed requests released their pages
        return results

    def _fail_requests(self, failed: set[str], message: str) -> list[RequestOutput]:
        """Fails every request with a sample in `failed`; their final outputs carry `message`."""
        results = []
        for request_id, group in list(self._groups.items()):
            if any(s.request_id in failed for s in group.samples):
                group.error = message
                self._fail_group(group)
                results.append(group.output(request_id))
                del self._groups[request_id]
        return results
