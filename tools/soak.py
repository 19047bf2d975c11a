"""A soak of mixed load against any OpenAI-compatible server, with a JSON report.

    python tools/soak.py --url http://127.0.0.1:8000 --requests 1000 --concurrency 16 --report soak.json
    python tools/soak.py --launch "--model DIR --max-model-len 256" --requests 300

Requests mix completions and chat, streamed and not, `/generate` (jaxserve's and vLLM's own) and
n > 1. A share of them (`--disconnect-rate`) is dropped mid-stream by the client, and a share
(`--bad-rate`) is bad on purpose: malformed JSON, wrong types, negative or huge max_tokens, a
prompt past max_model_len, an unknown model, invalid UTF-8, an oversized body, a long stop list.

Every request that was not dropped must end as a complete reply (a JSON body, or a stream closed
by `data: [DONE]` with a finish reason per choice) or, for a bad one, a 4xx JSON error. The report
counts each outcome; `failures` lists any 5xx, hang, truncated stream, bad input served, or good
input refused. Afterwards the server's running and waiting gauges must be back to 0; with
`--pid` (or `--launch`) its RSS before and after is reported. Exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from jaxserve.bench.launch import LaunchedServer

TIMEOUT_S = 300
QUESTIONS = ["Name three rivers.", "What is 2 + 2?", "Write a haiku about rain.", "Say hello in French.",
             "List the planets.", "Why is the sky blue?"]


def _good(rng: random.Random, model: str) -> tuple[str, dict]:
    """(path, body) of a valid request of a random kind."""
    stream, n, max_tokens = rng.random() < 0.5, rng.choice([1, 1, 1, 2]), rng.randint(4, 48)
    question = rng.choice(QUESTIONS)
    common = {"max_tokens": max_tokens, "temperature": rng.choice([0, 0.7]), "n": n, "stream": stream}
    kind = rng.choice(["completion", "chat", "chat", "generate"])
    if kind == "completion":
        return "/v1/completions", {"model": model, "prompt": question, **common}
    if kind == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": question}],
                                        **common}
    return "/generate", {"prompt": question, **common}


def _bad(rng: random.Random, model: str, max_model_len: int) -> tuple[str, dict | bytes, str]:
    """(path, body, kind) of a request every server must refuse with a 4xx."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    kinds = {
        "malformed JSON": b'{"model": "x", "messages": [',
        "wrong type": {**chat, "temperature": "hot"},
        "negative max_tokens": {**chat, "max_tokens": -5},
        "huge max_tokens": {**chat, "max_tokens": 10**9},
        "prompt past max_model_len": {"model": model, "prompt": "hello " * (2 * max_model_len), "max_tokens": 1},
        "unknown model": {**chat, "model": "no-such-model"},
        "invalid UTF-8": b'{"prompt": "\xff\xfe", "max_tokens": 1}',
        "oversized body": {"model": model, "prompt": "x" * (4 << 20), "max_tokens": 1},
        "long stop list": {**chat, "stop": [f"s{i}" for i in range(5000)]},
        "messages not a list": {"model": model, "messages": "hi"},
    }
    kind = rng.choice(sorted(kinds))
    path = "/v1/completions" if kind in ("prompt past max_model_len", "invalid UTF-8", "oversized body") \
        else "/v1/chat/completions"
    return path, kinds[kind], kind


async def _send(session: aiohttp.ClientSession, url: str, path: str, body, disconnect: bool) -> dict:
    """One request's outcome: status, kind of ending, latency."""
    started = time.perf_counter()
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        async with session.post(url + path, data=data, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as reply:
            if reply.status != 200:
                text = await reply.text()
                try:
                    json.loads(text)["error"]
                    ending = "json error"
                except (ValueError, KeyError, TypeError):
                    ending = "non-JSON error"
                return {"status": reply.status, "ending": ending, "seconds": time.perf_counter() - started}
            if reply.content_type != "text/event-stream":
                json.loads(await reply.text())
                return {"status": 200, "ending": "complete", "seconds": time.perf_counter() - started}
            return await _read_stream(reply, disconnect, body, started)
    except asyncio.TimeoutError:
        return {"status": None, "ending": "hang", "seconds": time.perf_counter() - started}
    except (aiohttp.ClientError, ValueError) as error:
        return {"status": None, "ending": f"broken: {type(error).__name__}", "seconds": time.perf_counter() - started}


async def _read_stream(reply, disconnect: bool, body: dict, started: float) -> dict:
    finished, events = set(), 0
    async for line in reply.content:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            wanted = body.get("n", 1)
            ending = "complete" if len(finished) >= wanted else "truncated"
            return {"status": 200, "ending": ending, "seconds": time.perf_counter() - started}
        event = json.loads(payload)
        if "error" in event:
            return {"status": 200, "ending": f"error event {event['error'].get('code')}",
                    "seconds": time.perf_counter() - started}
        events += 1
        for choice in event.get("choices", event.get("outputs", [])):
            if choice.get("finish_reason"):
                finished.add(choice.get("index", 0))
        if disconnect and events >= 2:
            reply.close()   # the client goes away mid-stream
            return {"status": 200, "ending": "disconnected", "seconds": time.perf_counter() - started}
    return {"status": 200, "ending": "truncated", "seconds": time.perf_counter() - started}


def _failure(outcome: dict) -> str | None:
    """Why an outcome is wrong, or None."""
    if outcome["ending"] == "disconnected":
        return None
    if outcome["bad"]:
        ok = outcome["status"] is not None and 400 <= outcome["status"] < 500 and outcome["ending"] == "json error"
        return None if ok else f"bad input ({outcome['kind']}) got {outcome['status']} {outcome['ending']}"
    if outcome["status"] == 200 and outcome["ending"] == "complete":
        return None
    return f"{outcome['kind']} got {outcome['status']} {outcome['ending']}"


async def soak(args, url: str) -> dict:
    rng = random.Random(args.seed)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}) \
            as session:
        async with session.get(f"{url}/v1/models") as reply:
            card = (await reply.json())["data"][0]
        model, max_model_len = card["id"], card.get("max_model_len") or 2048
        queue: asyncio.Queue = asyncio.Queue()
        for _ in range(args.requests):
            if rng.random() < args.bad_rate:
                path, body, kind = _bad(rng, model, max_model_len)
                queue.put_nowait((path, body, kind, True, False))
            else:
                path, body = _good(rng, model)
                disconnect = body.get("stream", False) and rng.random() < args.disconnect_rate
                queue.put_nowait((path, body, path, False, disconnect))
        outcomes, health = [], []

        async def worker():
            while not queue.empty():
                path, body, kind, bad, disconnect = queue.get_nowait()
                outcome = await _send(session, url, path, body, disconnect)
                outcomes.append({**outcome, "kind": kind, "bad": bad})

        async def probe():
            while len(outcomes) < args.requests:
                started = time.perf_counter()
                async with session.get(f"{url}/health") as reply:
                    await reply.read()
                health.append(time.perf_counter() - started)
                await asyncio.sleep(0.5)

        started = time.perf_counter()
        prober = asyncio.create_task(probe())
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        await prober
        elapsed = time.perf_counter() - started
        gauges = await _settled_gauges(session, url)
    endings: dict[str, int] = {}
    for outcome in outcomes:
        endings[outcome["ending"]] = endings.get(outcome["ending"], 0) + 1
    failures = [f for f in map(_failure, outcomes) if f]
    if any(gauges.get(name, 0) != 0 for name in ("num_requests_running", "num_requests_waiting")):
        failures.append(f"after the soak the gauges read {gauges}")
    return {"requests": len(outcomes), "seconds": round(elapsed, 1), "endings": endings,
            "statuses": _count(str(o["status"]) for o in outcomes), "failures": failures,
            "health_p50_ms": round(statistics.median(health) * 1000, 1) if health else None,
            "latency_p50_s": round(statistics.median(o["seconds"] for o in outcomes), 2), "gauges_after": gauges}


async def _settled_gauges(session, url: str, timeout: float = 30) -> dict:
    """jaxserve's (or vLLM's) running/waiting gauges once they settle (a dropped stream is aborted
    within a step)."""
    deadline = time.monotonic() + timeout
    while True:
        async with session.get(f"{url}/metrics") as reply:
            text = await reply.text()
        gauges = {m.group(1): float(m.group(2)) for m in re.finditer(
            r"^\w+:(num_requests_running|num_requests_waiting)(?:\{[^}]*\})? ([\d.e+-]+)$", text, re.M)}
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.5)


def _count(values) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def rss_mib(pid: int) -> float | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="the server's base URL (without /v1)")
    parser.add_argument("--launch", help="start `python -m jaxserve.serve FLAGS` for the soak instead")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--disconnect-rate", type=float, default=0.2, help="share of streams dropped mid-way")
    parser.add_argument("--bad-rate", type=float, default=0.1, help="share of requests that are bad on purpose")
    parser.add_argument("--api-key")
    parser.add_argument("--pid", type=int, help="the server's process id, for its RSS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", type=Path, help="write the JSON report here")
    args = parser.parse_args()
    if (args.url is None) == (args.launch is None):
        parser.error("give exactly one of --url and --launch")
    if args.launch is not None:
        with tempfile.TemporaryDirectory() as folder:
            with LaunchedServer(args.launch, Path(folder) / "server.log") as server:
                report = _with_rss(args, server.url, server.process.pid)
    else:
        report = _with_rss(args, args.url.rstrip("/"), args.pid)
    text = json.dumps(report, indent=2)
    print(text)
    if args.report:
        args.report.write_text(text)
    return 1 if report["failures"] else 0


def _with_rss(args, url: str, pid: int | None) -> dict:
    before = rss_mib(pid) if pid else None
    report = asyncio.run(soak(args, url))
    if pid:
        report["rss_mib"] = {"before": before, "after": rss_mib(pid)}
    return report


if __name__ == "__main__":
    sys.exit(main())
