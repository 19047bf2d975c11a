"""AsyncEngine: the engine thread, per-request streams, abort, failures, queue limit, drain."""

import asyncio
import dataclasses
import time

import pytest

from jaxserve.engine.async_engine import (
    AsyncEngine, EngineState, EngineUnavailableError, QueueFullError, RequestFailedError)
from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from server_fixtures import pool_is_full, tiny_engine  # noqa: F401 - fixture

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def run(engine, scenario, **kwargs):
    """Runs `scenario(async_engine)` on a fresh event loop with the engine thread started."""
    async def main():
        async_engine = AsyncEngine(engine, **kwargs)
        await async_engine.start()
        await async_engine.wait_ready()
        try:
            return await scenario(async_engine)
        finally:
            await async_engine.drain(timeout=5)
            await async_engine.stop()
    return asyncio.run(main())


def sync_generate(engine, prompt, params):
    request_id = engine.add_request(prompt, params)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output


async def collect(stream):
    return [output async for output in stream]


def slow_steps(monkeypatch, engine, seconds):
    execute = engine.runner.launch

    def slow(output, *rest):
        time.sleep(seconds)
        return execute(output, *rest)

    monkeypatch.setattr(engine.runner, "launch", slow)


async def fill_the_batch(engine) -> list:
    """8 running sequences (max_num_seqs=8), added one at a time, so none counts against a small queue."""
    busy = []
    for i in range(8):
        busy.append(await engine.add_request(f"busy {i}", SamplingParams(max_tokens=50)))
        await anext(busy[-1])   # its first token: running, not waiting
    return busy


def close_all(streams) -> None:
    for stream in streams:
        stream.close()


def test_stream_is_cumulative_and_matches_a_synchronous_run(tiny_engine):
    expected = sync_generate(tiny_engine, "The sea is", GREEDY)

    async def scenario(engine):
        return await collect(await engine.add_request("The sea is", GREEDY))

    outputs = run(tiny_engine, scenario)
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert all(a == b[:len(a)] for a, b in zip(tokens, tokens[1:])), "each output extends the previous"
    assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert outputs[-1].outputs[0].text == expected.outputs[0].text
    assert pool_is_full(tiny_engine)


def test_a_consumer_behind_gets_the_latest_cumulative_output_or_the_deltas_joined(tiny_engine):
    params = dataclasses.replace(GREEDY, logprobs=1, prompt_logprobs=1)
    reference = sync_generate(tiny_engine, "The sea is", params)
    expected = reference.outputs[0]

    async def scenario(engine):
        cumulative = await engine.add_request("The sea is", params)
        delta = await engine.add_request("The sea is", dataclasses.replace(params, output_kind=RequestOutputKind.DELTA))
        first = await anext(delta)   # one read at the first token; the rest waits until both have finished
        while not (cumulative.finished and delta.finished):
            await asyncio.sleep(0.01)
        return await collect(cumulative), [first, *await collect(delta)]

    cumulative, deltas = run(tiny_engine, scenario)
    assert [o.finished for o in cumulative] == [True]
    assert (cumulative[0].outputs[0].token_ids, cumulative[0].outputs[0].text) == (expected.token_ids, expected.text)
    assert [o.finished for o in deltas] in ([False, True], [True])   # the first read may find the end already
    assert [t for o in deltas for t in o.outputs[0].token_ids] == expected.token_ids
    assert "".join(o.outputs[0].text for o in deltas) == expected.text
    joined_logprobs = [lp for o in deltas for lp in o.outputs[0].logprobs]   # batched with the other: ~1e-6 apart
    assert [lp.token_id for lp in joined_logprobs] == [lp.token_id for lp in expected.logprobs]
    assert [lp.logprob for lp in joined_logprobs] == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-4)
    assert len(deltas[0].prompt_logprobs) == len(reference.prompt_logprobs) and deltas[-1].outputs[0].logprobs
    assert all(o.prompt_logprobs is None for o in deltas[1:])
    assert deltas[-1].outputs[0].finish_reason == expected.finish_reason
    assert pool_is_full(tiny_engine)


def _content(output):
    """What a cumulative output holds for its client (not its timings or cached tokens)."""
    return (output.finished, output.prompt_logprobs,
            [(o.index, o.text, o.token_ids, o.finish_reason, o.logprobs, o.cumulative_logprob) for o in output.outputs])


def test_a_cumulative_stream_holds_what_the_engines_cumulative_outputs_hold(tiny_engine):
    """The engine makes a cumulative stream's outputs as deltas, and the stream adds them up: each
    output read equals one the engine makes as CUMULATIVE (samples, logprobs, prompt logprobs, a
    stop string), in order, the last one included."""
    params = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=10, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    reference = sync_generate(tiny_engine, "The sea is", params).outputs[0].text
    params = dataclasses.replace(params, stop=[reference[len(reference) // 2:][:2]])
    request_id = tiny_engine.add_request("The sea is", params)
    expected = []
    while tiny_engine.has_unfinished_requests():
        expected += [_content(o) for o in tiny_engine.step() if o.request_id == request_id]

    async def scenario(engine):
        return await collect(await engine.add_request("The sea is", params))

    got = [_content(o) for o in run(tiny_engine, scenario)]
    assert got[-1] == expected[-1] and got[-1][0] and any(o[3] == "stop" for o in got[-1][2])
    positions = [expected.index(output) for output in got]   # each one the engine's, in order
    assert positions == sorted(positions) and len(got) > 2
    assert pool_is_full(tiny_engine)


class _Recorder:
    """A RequestObserver that keeps what it is told."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, args))


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_the_observer_hears_every_token_once_whatever_the_output_kind(tiny_engine, kind):
    recorder = _Recorder()
    prompt = tiny_engine.tokenizer.encode("The sea is", add_special_tokens=False)

    async def scenario(engine):
        return await collect(await engine.add_request(prompt, dataclasses.replace(GREEDY, output_kind=kind)))

    run(tiny_engine, scenario, observer=recorder)
    heard = {}
    for name, args in recorder.calls:
        heard.setdefault(name, []).append(args)
    assert heard["prompt_tokens"] == [(len(prompt),)]
    assert len(heard["first_token"]) == 1 and len(heard["finished"]) == 1
    [(finished,)] = heard["finished"]   # whole counts, though a delta stream's last output holds one token
    assert (finished.num_prompt_tokens, finished.num_output_tokens, finished.finish_reasons) == (len(prompt), 12,
                                                                                                 ["length"])
    assert finished.times.arrival_time <= finished.times.first_scheduled_time <= finished.times.first_token_time
    new_tokens = heard["new_tokens"]
    assert [count for count, _ in new_tokens] == [1] * 12   # one token a step, each heard once
    assert new_tokens[0][1] is None and all(gap > 0 for _, gap in new_tokens[1:])


def test_n_samples_share_one_stream(tiny_engine):
    async def scenario(engine):
        return await collect(await engine.add_request("Once", SamplingParams(n=3, max_tokens=5, seed=7)))

    final = run(tiny_engine, scenario)[-1]
    assert [o.index for o in final.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in final.outputs)


def test_priority_is_passed_to_the_engine(tiny_engine, monkeypatch):
    add_request = tiny_engine.add_request
    seen = []

    def record(prompt, params, request_id=None, priority=0, lora_request=None):
        seen.append((request_id, priority))
        return add_request(prompt, params, request_id, priority, lora_request)

    monkeypatch.setattr(tiny_engine, "add_request", record)

    async def scenario(engine):
        await collect(await engine.add_request("a", GREEDY, "low", priority=5))
        await collect(await engine.add_request("b", GREEDY, "default"))

    run(tiny_engine, scenario)
    assert seen == [("low", 5), ("default", 0)]


def test_best_of_counts_every_sample_against_the_queue_limit(tiny_engine, monkeypatch):
    slow_steps(monkeypatch, tiny_engine, 0.05)

    async def scenario(engine):
        busy = await fill_the_batch(engine)
        waiting = await engine.add_request("ranked", SamplingParams(n=1, best_of=3, max_tokens=4))
        with pytest.raises(QueueFullError, match="3 sequences are waiting"):
            await engine.add_request("refused", GREEDY)
        close_all(busy)
        return (await collect(waiting))[-1]

    final = run(tiny_engine, scenario, max_queue=3)
    assert final.finished and len(final.outputs) == 1


def test_best_of_aborted_before_its_first_token_leaves_the_engine_serving(tiny_engine, monkeypatch):
    slow_steps(monkeypatch, tiny_engine, 0.05)

    async def scenario(engine):
        busy = await engine.add_request("busy", SamplingParams(n=8, max_tokens=50))
        await anext(busy)  # the batch is full: the next request waits
        ranked = await engine.add_request("ranked", SamplingParams(best_of=3, max_tokens=20))
        ranked.close()
        busy.close()
        return (await collect(await engine.add_request("after", GREEDY)))[-1], engine.state

    final, state = run(tiny_engine, scenario)
    assert final.finished and state is EngineState.READY
    assert pool_is_full(tiny_engine)


def test_invalid_request_raises_before_streaming_and_engine_keeps_serving(tiny_engine):
    async def scenario(engine):
        with pytest.raises(InvalidRequestError, match=r"200 tokens.*max_model_len is 128"):
            await engine.add_request([5] * 200, GREEDY)
        return await collect(await engine.add_request("ok", GREEDY))

    assert run(tiny_engine, scenario)[-1].outputs[0].finish_reason == "length"


def test_close_aborts_within_one_step(tiny_engine, monkeypatch):
    slow_steps(monkeypatch, tiny_engine, 0.1)

    async def scenario(engine):
        stream = await engine.add_request("Long", SamplingParams(max_tokens=100))
        await anext(stream)
        await anext(stream)
        assert not pool_is_full(tiny_engine)
        stream.close()
        closed = time.monotonic()
        while not pool_is_full(tiny_engine):
            await asyncio.sleep(0.005)
        return time.monotonic() - closed

    assert run(tiny_engine, scenario) < 0.25  # one 0.1 s step in flight, then the abort


def test_cancelled_consumer_aborts(tiny_engine, monkeypatch):
    slow_steps(monkeypatch, tiny_engine, 0.05)

    async def scenario(engine):
        async def consume():
            async with await engine.add_request("Long", SamplingParams(max_tokens=100)) as stream:
                async for _ in stream:
                    pass
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        deadline = time.monotonic() + 1
        while not pool_is_full(tiny_engine) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return pool_is_full(tiny_engine), engine.stats.num_running

    assert run(tiny_engine, scenario) == (True, 0)


def test_runner_failure_fails_that_request_only(tiny_engine, monkeypatch):
    execute = tiny_engine.runner.launch
    calls = []

    def fail_once(output, *rest):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device on fire")
        return execute(output, *rest)

    monkeypatch.setattr(tiny_engine.runner, "launch", fail_once)

    async def scenario(engine):
        with pytest.raises(RequestFailedError, match="device on fire"):
            await collect(await engine.add_request("x", GREEDY))
        return await collect(await engine.add_request("y", GREEDY))

    assert run(tiny_engine, scenario)[-1].outputs[0].finish_reason == "length"
    assert pool_is_full(tiny_engine)


def test_exception_escaping_step_fails_in_flight_requests_and_serving_goes_on(tiny_engine, monkeypatch):
    slow_steps(monkeypatch, tiny_engine, 0.02)   # "a" (12 tokens) still runs when "b" comes
    scheduler = tiny_engine.scheduler
    schedule, failed = scheduler.schedule, []

    def fail_once_both_came(*args):
        # Not "the third call": "b" may reach the engine after it (a CI run saw "b" served whole).
        if not failed and len(scheduler.running) + scheduler.num_waiting == 2:
            failed.append(1)
            raise ValueError("scheduler bug")
        return schedule(*args)

    monkeypatch.setattr(scheduler, "schedule", fail_once_both_came)

    async def scenario(engine):
        streams = [await engine.add_request(p, GREEDY) for p in ("a", "b")]
        for stream in streams:
            with pytest.raises(RequestFailedError, match="scheduler bug"):
                await collect(stream)
        return await collect(await engine.add_request("c", GREEDY))

    assert run(tiny_engine, scenario)[-1].finished
    assert pool_is_full(tiny_engine) and not tiny_engine.has_unfinished_requests()


def test_queue_limit(tiny_engine, monkeypatch):
    slow_steps(monkeypatch, tiny_engine, 0.05)

    async def scenario(engine):
        # The next request waits, the one after is refused.
        busy = await fill_the_batch(engine)
        waiting = await engine.add_request("wait", GREEDY)
        with pytest.raises(QueueFullError, match="1 sequences are waiting"):
            await engine.add_request("refused", GREEDY)
        close_all(busy)
        return (await collect(waiting))[-1]

    assert run(tiny_engine, scenario, max_queue=1).finished


def test_a_batch_is_admitted_as_a_unit(tiny_engine, monkeypatch):
    slow_steps(monkeypatch, tiny_engine, 0.05)

    async def scenario(engine):
        busy = await fill_the_batch(engine)
        waiting = await engine.add_requests(["a", "b"], GREEDY, ["a", "b"])
        with pytest.raises(QueueFullError, match="2 sequences are waiting and this request adds 2"):
            await engine.add_requests(["c", "d"], GREEDY, ["c", "d"])   # 1 more would fit: none is taken
        with pytest.raises(InvalidRequestError, match="5 sequences .* more than --max-queue=3 can ever hold"):
            await engine.add_requests(list("efghi"), GREEDY, list("efghi"))
        assert engine.stats.num_waiting == 2 and set(engine._streams) == {s.request_id for s in busy} | {"a", "b"}
        close_all(busy)
        return [(await collect(stream))[-1] for stream in waiting]

    assert all(final.finished for final in run(tiny_engine, scenario, max_queue=3))


def test_drain_finishes_running_requests_and_refuses_new_ones(tiny_engine):
    async def scenario(engine):
        stream = await engine.add_request("drain me", GREEDY)
        drained = asyncio.create_task(engine.drain(timeout=30))
        await asyncio.sleep(0)
        assert engine.state is EngineState.DRAINING
        with pytest.raises(EngineUnavailableError):
            await engine.add_request("late", GREEDY)
        outputs = await collect(stream)
        await drained
        return outputs[-1]

    final = run(tiny_engine, scenario)
    assert final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 12


def test_drain_timeout_aborts_what_is_left(tiny_engine, monkeypatch):
    slow_steps(monkeypatch, tiny_engine, 0.05)

    async def scenario(engine):
        stream = await engine.add_request("forever", SamplingParams(max_tokens=120))
        await engine.drain(timeout=0.2)
        return await collect(stream)

    final = run(tiny_engine, scenario)[-1]
    assert final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) < 120
    assert pool_is_full(tiny_engine)


def test_engine_built_on_its_thread_and_build_errors_surface():
    def build():
        raise FileNotFoundError("no such model")

    async def scenario():
        engine = AsyncEngine(build)
        await engine.start()
        with pytest.raises(FileNotFoundError, match="no such model"):
            await engine.wait_ready()
        assert engine.state is EngineState.FAILED
        with pytest.raises(EngineUnavailableError):
            await engine.add_request("x", GREEDY)
        await engine.stop()

    asyncio.run(scenario())
