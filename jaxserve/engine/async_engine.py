"""`AsyncEngine`: an `LLMEngine` driven by its own thread, with one async stream per request.

`LLMEngine` is not thread-safe, so only the engine thread touches it. The event loop hands it
work through a thread-safe command queue (add, abort, call, stop) that the thread drains between
steps; the thread posts each step's outputs back with `loop.call_soon_threadsafe`, all of a
step's outputs in one callback. A stream whose consumer goes away (a client disconnect cancels
its handler) sends an abort, which the thread applies before the next step, so the request's
pages are back in the pool within one step.

Admission is two-phase: `add_request` returns only once the engine thread has accepted the
request, so a request the engine rejects raises to the caller before anything is streamed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from jaxserve.engine.engine import EngineStats, LLMEngine
from jaxserve.engine.output import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.errors import InvalidRequestError
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class EngineUnavailableError(RuntimeError):
    """The engine takes no requests now (loading, draining, stopped)."""


class QueueFullError(RuntimeError):
    """More sequences are waiting than `max_queue` allows."""


class RequestFailedError(RuntimeError):
    """The engine failed this request: an exception in its step, or, with `param`, something the
    request asked for that cannot be done (a structured-output constraint with no way on)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class FinishedRequest:
    """What a `RequestObserver` hears of a request that ended."""

    finish_reasons: list[str]        # per sample
    e2e_seconds: float               # from arrival at the async engine
    finished_time: float             # time.monotonic()
    params: SamplingParams
    lora_name: str | None = None     # the LoRA adapter it ran with
    # Of a request that ran to its end (None: closed by its consumer first, or failed):
    num_prompt_tokens: int | None = None
    num_output_tokens: int | None = None   # every returned sample's tokens (best_of: the n best's)
    times: RequestMetrics | None = None


class RequestObserver(Protocol):
    """Told about each request's progress, on the event loop (metrics), and about each engine
    step's tokens, on the engine thread."""

    def prompt_tokens(self, count: int) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def new_tokens(self, count: int, seconds_since_last: float | None) -> None: ...
    def finished(self, request: FinishedRequest) -> None: ...
    def iteration_tokens(self, count: int) -> None: ...


class RequestStream:
    """The outputs of one request, as its `output_kind` asks; iterate with `async for`. A reader
    that has fallen behind (a slow client, a busy event loop) gets, of the outputs waiting, the
    latest cumulative one, or the deltas joined into one (as vLLM's): its work per read stays
    bounded either way.

    The engine makes a cumulative stream's outputs as deltas (`AsyncEngine` asks it for DELTA),
    and the stream adds them up here, on the event loop. So the engine thread does not copy every
    sample's tokens at every step, a cost that grows with the output (256 streams at their 448th
    token: the engine's outputs took 1.60-1.76 ms a step as cumulative ones, 1.32-1.37 as deltas).
    The server streams deltas, and adds nothing up.

    `close()` (also on leaving `async with`) aborts the request if it has not finished.
    """

    def __init__(self, request_id: str, params: SamplingParams, abort: Callable[[str], None],
                 observer: RequestObserver | None, lora_name: str | None = None):
        self.request_id = request_id
        self.params = params
        self.lora_name = lora_name
        self.num_samples = params.n
        # the outputs so far of a cumulative stream, whose engine outputs are deltas
        self._sums = _OutputSums() if params.output_kind == RequestOutputKind.CUMULATIVE else None
        self._deltas = params.streams   # each engine output holds only what is new (else: everything)
        self.finished = False
        self._abort = abort
        self._observer = observer
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._arrival = self._last = time.monotonic()
        self._num_tokens: int | None = None   # None until the first output
        self._done = False                    # the consumer has seen the final output

    def put(self, output: RequestOutput, when: float) -> None:
        """An output of the engine's (a delta, unless the request asked for its final output only)."""
        self.finished = output.finished
        if self._sums is not None:
            self._sums.add(output)
        if self._observer is not None:
            total = sum(len(o.token_ids) for o in output.outputs)
            if self._deltas:
                total += self._num_tokens or 0
            self._observe(len(output.prompt_token_ids), total, when)
            if output.finished:
                self._observer.finished(self._finished_request(output, total, when))
        self._queue.put_nowait(output)

    def _finished_request(self, output: RequestOutput, total: int, when: float) -> FinishedRequest:
        if output.error:
            return FinishedRequest(["error"] * self.num_samples, when - self._arrival, when, self.params,
                                   self.lora_name)
        return FinishedRequest([o.finish_reason or "abort" for o in output.outputs], when - self._arrival, when,
                               self.params, self.lora_name, len(output.prompt_token_ids), total, output.metrics)

    def progress(self, num_prompt_tokens: int, num_output_tokens: int, when: float) -> None:
        """A step that moved the request without an output for it (`LLMEngine.progress_observer`)."""
        if self._observer is not None:
            self._observe(num_prompt_tokens, num_output_tokens, when)

    def _observe(self, num_prompt_tokens: int, total: int, when: float) -> None:
        """`total`: the output tokens so far (a best_of request's final output holds only the n best:
        fewer than its steps made, and nothing is taken back)."""
        if self._num_tokens is None:
            self._observer.prompt_tokens(num_prompt_tokens)
            if total:
                self._observer.first_token(when - self._arrival)
                self._observer.new_tokens(total, None)
        elif total > self._num_tokens:
            self._observer.new_tokens(total - self._num_tokens, when - self._last)
        else:
            return
        self._num_tokens, self._last = total, when

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        waiting = [await self._queue.get()]
        while not waiting[-1].finished and not self._queue.empty():   # the reader has fallen behind
            waiting.append(self._queue.get_nowait())
        output = waiting[-1]
        if self._sums is None and len(waiting) > 1:   # deltas: joined into one
            output = _OutputSums.joined(waiting)
        self._done = output.finished
        if output.error:
            raise RequestFailedError(output.error, output.error_param)
        # Every delta put so far is read now (the last one ends the stream), so the sums are this output's.
        return self._sums.output() if self._sums is not None else output

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)
            if self._observer is not None:
                now = time.monotonic()
                self._observer.finished(FinishedRequest(["abort"] * self.num_samples, now - self._arrival, now,
                                                        self.params, self.lora_name))

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()


class _OutputSums:
    """A request's deltas added up into the cumulative output the engine would have made (or a
    reader's waiting deltas joined into one): each sample's text, tokens and logprobs so far, and
    the prompt's logprobs, which only the first delta holds. Samples keep their index in every
    delta (all of them are in each one)."""

    def __init__(self):
        self._texts: dict[int, str] = {}
        self._token_ids: dict[int, list[int]] = {}
        self._logprobs: dict[int, list] = {}
        self._prompt_logprobs = None
        self._latest: RequestOutput | None = None

    def add(self, delta: RequestOutput) -> None:
        for sample in delta.outputs:
            i = sample.index
            self._texts[i] = self._texts.get(i, "") + sample.text
            self._token_ids.setdefault(i, []).extend(sample.token_ids)
            if sample.logprobs is not None:
                self._logprobs.setdefault(i, []).extend(sample.logprobs)
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs
        self._latest = delta

    @classmethod
    def joined(cls, deltas: list[RequestOutput]) -> RequestOutput:
        """Deltas in order as one."""
        sums = cls()
        for delta in deltas:
            sums.add(delta)
        return sums.output()

    def output(self) -> RequestOutput:
        """Everything so far: the latest delta, with each sample's sums in copies of their own."""
        samples = [CompletionOutput(
            s.index, self._texts[s.index], list(self._token_ids[s.index]), s.finish_reason,
            None if s.logprobs is None else list(self._logprobs.get(s.index, ())), s.cumulative_logprob)
            for s in self._latest.outputs]
        return dataclasses.replace(self._latest, outputs=samples, prompt_logprobs=self._prompt_logprobs)


class AsyncEngine:
    """Serves an `LLMEngine` (or builds one with `build()` on its thread, so that loading and
    compiling do not block the event loop)."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_queue: int | None = None,
                 observer: RequestObserver | None = None):
        self._build = (lambda: engine) if isinstance(engine, LLMEngine) else engine
        self.engine: LLMEngine | None = None
        self.max_queue = max_queue
        self.observer = observer
        self.state = EngineState.LOADING
        self.stats = EngineStats()
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._progress: dict[str, tuple[int, int]] = {}   # the engine thread's, for the step it runs
        self._streams: dict[str, RequestStream] = {}
        self._pending = 0           # sequences sent to the thread, not yet in `stats`
        self._ids = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()

    def loaded(self) -> LLMEngine:
        """The engine, for read-only facts (tokenizer, max_model_len); raises while it is loading."""
        if self.engine is None:
            raise EngineUnavailableError(f"the engine is {self.state.value}")
        return self.engine

    # ---- lifecycle (event loop side) ---------------------------------------------------------

    async def start(self) -> None:
        """Starts the engine thread; returns at once (see `wait_ready`)."""
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
            self._thread.start()

    async def wait_ready(self) -> None:
        """Waits for the engine to be built; raises what building it raised."""
        await self._ready.wait()
        if self.error is not None:
            raise self.error

    async def drain(self, timeout: float) -> None:
        """Takes no new requests; lets running ones finish for `timeout` seconds, then aborts the rest."""
        if self.state is EngineState.READY:
            self.state = EngineState.DRAINING
        self._idle.clear()
        if self._streams:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("aborting %d requests still running after %.0f s", len(self._streams), timeout)
        for request_id in list(self._streams):
            self._commands.put(("abort", request_id))

    async def stop(self) -> None:
        """Stops the engine thread (after `drain`, or aborting whatever still runs)."""
        if self._thread is not None:
            self._commands.put(("stop",))
            # A thread still building the engine cannot be interrupted, and a failed engine's may be
            # stuck in a step (a lost follower process); it is a daemon, leave it.
            if self.state not in (EngineState.LOADING, EngineState.FAILED):
                await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        self.state = EngineState.STOPPED

    # ---- requests (event loop side) -------------------------------------------------------

    async def add_request(self, prompt: str | list[int], params: SamplingParams,
                          request_id: str | None = None, priority: int = 0,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Queues a request (`priority`: lower runs sooner under the priority scheduling policy;
        `lora_request`: its LoRA adapter); raises InvalidRequestError, QueueFullError or
        EngineUnavailableError."""
        [stream] = await self.add_requests([prompt], params, [request_id], priority, lora_request)
        return stream

    async def add_requests(self, prompts: Sequence[str | list[int]], params: SamplingParams,
                           request_ids: Sequence[str | None], priority: int = 0,
                           lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """Queues several requests as one unit: all are admitted or none (a batch that can never
        fit `max_queue` is an InvalidRequestError, one that does not fit now a QueueFullError)."""
        if self.state is not EngineState.READY:
            raise EngineUnavailableError(f"the engine is {self.state.value}")
        self._check_queue(len(prompts), params.num_samples)
        for request_id in request_ids:
            if request_id is not None and request_id in self._streams:
                raise InvalidRequestError("request_id", f"request_id={request_id!r} is already in use")
        # Every command goes out before the first await, so no other request can slip in between.
        submitted = [self._submit(prompt, params, request_id, priority, lora_request)
                     for prompt, request_id in zip(prompts, request_ids, strict=True)]
        try:
            for _, accepted in submitted:
                await asyncio.shield(accepted)
        except BaseException:
            for stream, accepted in submitted:
                if accepted.done() and not accepted.cancelled() and accepted.exception() is not None:
                    self._forget(stream.request_id)   # refused: never admitted
                else:
                    stream.close()   # admitted, or may still be: aborted right after
            raise
        return [stream for stream, _ in submitted]

    def _check_queue(self, num_prompts: int, num_samples: int) -> None:
        if self.max_queue is None:
            return
        num_seqs = num_prompts * num_samples
        if num_seqs > self.max_queue:   # no retry can help: a 400 at once, never work thrown away
            raise InvalidRequestError("prompt" if num_prompts > 1 else "n",
                                      f"the request makes {num_seqs} sequences ({num_prompts} prompts x "
                                      f"{num_samples} samples), more than --max-queue={self.max_queue} "
                                      f"can ever hold: split it")
        waiting = self.stats.num_waiting + self._pending
        if waiting + num_seqs > self.max_queue:
            raise QueueFullError(f"{waiting} sequences are waiting and this request adds {num_seqs} "
                                 f"(--max-queue={self.max_queue})")

    async def call(self, function: Callable[[LLMEngine], T]) -> T:
        """`function(engine)` run on the engine thread between steps (the engine is not thread-safe):
        what it returns, or raises."""
        if self.state is not EngineState.READY:
            raise EngineUnavailableError(f"the engine is {self.state.value}")
        done = self._loop.create_future()
        self._commands.put(("call", function, done))
        return await done

    def _submit(self, prompt: str | list[int], params: SamplingParams, request_id: str | None,
                priority: int, lora_request: LoRARequest | None) -> tuple[RequestStream, asyncio.Future]:
        if request_id is None:
            self._ids += 1
            request_id = f"req-{self._ids}"
        stream = RequestStream(request_id, params, self._send_abort, self.observer,
                               lora_request.lora_name if lora_request else None)
        self._streams[request_id] = stream
        accepted = self._loop.create_future()
        self._pending += params.num_samples
        # A batch's caller reads the first failure only: the others are marked retrieved here.
        accepted.add_done_callback(lambda f: f.cancelled() or f.exception())
        if params.output_kind == RequestOutputKind.CUMULATIVE:   # the stream adds the deltas up
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        self._commands.put(("add", request_id, prompt, params, priority, lora_request, accepted))
        return stream, accepted

    def _send_abort(self, request_id: str) -> None:
        self._forget(request_id)
        self._commands.put(("abort", request_id))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()

    # ---- callbacks posted by the engine thread (run on the event loop) ----------------------

    def _post(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _on_built(self, error: BaseException | None) -> None:
        self.error = error
        self.state = EngineState.FAILED if error else EngineState.READY
        self._ready.set()

    def _on_added(self, accepted: asyncio.Future, num_seqs: int, error: Exception | None,
                  stats: EngineStats) -> None:
        self._pending -= num_seqs
        self.stats = stats
        if accepted.done():
            return
        if error is None:
            accepted.set_result(None)
        else:
            accepted.set_exception(error)

    def fail(self, message: str) -> None:
        """Fails every request now and takes no more (on the event loop): the engine cannot go on."""
        self._on_crashed(message)

    def _on_crashed(self, message: str) -> None:
        self.state = EngineState.FAILED
        for request_id, stream in list(self._streams.items()):
            stream.put(RequestOutput(request_id, None, [], [], True, message), time.monotonic())
            self._forget(request_id)

    def _on_outputs(self, outputs: list[RequestOutput], when: float, stats: EngineStats,
                    progress: dict[str, tuple[int, int]] | None = None) -> None:
        self.stats = stats
        for request_id, counts in (progress or {}).items():
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.progress(*counts, when)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted by its consumer: nobody reads it
            stream.put(output, when)
            if output.finished:
                self._forget(output.request_id)

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._build()
        except BaseException as error:  # noqa: BLE001 - reported to whoever awaits wait_ready
            self._post(self._on_built, error)
            return
        self._post(self._on_built, None)
        if self.observer is not None:   # the engine's step hooks now feed this server's metrics
            self.engine.step_observer = lambda times: self.observer.iteration_tokens(times.num_tokens)
            self.engine.progress_observer = lambda counts: self._progress.update(counts)
        live: set[str] = set()
        try:
            while self._handle_commands(live, block=not live):
                if live:
                    self._step(live)
        except BaseException as error:  # noqa: BLE001 - a bug outside a step: fail loudly, not hang
            log.exception("engine thread crashed")
            self._post(self._on_crashed, f"engine thread crashed: {type(error).__name__}: {error}")

    def _handle_commands(self, live: set[str], block: bool) -> bool:
        """Applies queued commands (waiting for one if `block`); False once told to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command[0] == "stop":
                for request_id in list(live):
                    self._abort(live, request_id)
                return False
            if command[0] == "add":
                self._add(live, *command[1:])
            elif command[0] == "call":
                self._call(*command[1:])
            else:
                self._abort(live, command[1])

    def _add(self, live: set[str], request_id: str, prompt, params: SamplingParams, priority: int,
             lora_request: LoRARequest | None, accepted: asyncio.Future) -> None:
        error = None
        try:
            self.engine.add_request(prompt, params, request_id, priority, lora_request)
            live.add(request_id)
        except Exception as exc:  # noqa: BLE001 - the caller gets it (InvalidRequestError: a 400)
            error = exc
        self._post(self._on_added, accepted, params.num_samples, error, self.engine.stats())

    def _call(self, function, done: asyncio.Future) -> None:
        try:
            result, error = function(self.engine), None
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            result, error = None, exc
        self._post(_settle, done, result, error)

    def _abort(self, live: set[str], request_id: str) -> None:
        live.discard(request_id)
        output = self.engine.abort(request_id)
        if output is not None:
            self._post(self._on_outputs, [output], time.monotonic(), self.engine.stats())

    def _step(self, live: set[str]) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001 - fail what was in flight, keep serving
            log.exception("engine step raised")
            outputs = self._fail_all(live, f"engine step failed: {type(error).__name__}: {error}")
        for output in outputs:
            if output.finished:
                live.discard(output.request_id)
        progress, self._progress = self._progress, {}
        self._post(self._on_outputs, outputs, time.monotonic(), self.engine.stats(), progress)

    def _fail_all(self, live: set[str], message: str) -> list[RequestOutput]:
        failed = []
        for request_id in list(live):
            try:
                output = self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine's state is suspect; report the request anyway
                output = None
            output = output or RequestOutput(request_id, None, [], [], True)
            failed.append(dataclasses.replace(output, finished=True, error=message))
        return failed


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(result)
