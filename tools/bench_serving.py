"""Online serving benchmark: replays a workload against any OpenAI-compatible `/v1/completions`.

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 \
        --workload ../shared/workloads/anchor-64.jsonl --concurrency 8
    python tools/bench_serving.py ... --request-rate 4          # Poisson arrivals, 4 requests/s

Every request streams, asks for the workload line's `max_tokens` with `ignore_eos: true` and
greedy sampling, so every system makes the same number of tokens. Per request it measures the
time to first token (TTFT), the time per output token after the first (TPOT), the gaps between
streamed chunks (ITL) and the end-to-end latency; it prints p50/p95/p99 of each, requests/s and
output tokens/s, and writes a JSON result and (with matplotlib) a PNG of the distributions.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

from bench_offline import read_workload

PERCENTILES = (50, 95, 99)


@dataclasses.dataclass
class Result:
    prompt_tokens: int
    max_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.e2e is None or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def request_body(row: dict, model: str, send_text: bool) -> dict:
    return {"model": model, "prompt": row["prompt_text"] if send_text else row["prompt_token_ids"],
            "max_tokens": row["max_tokens"], "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


async def send(session: aiohttp.ClientSession, url: str, body: dict, row: dict) -> Result:
    """One streamed completion, timed."""
    result = Result(len(row["prompt_token_ids"]), row["max_tokens"])
    chunks = 0
    started = last = time.perf_counter()
    try:
        async with session.post(url, json=body) as reply:
            if reply.status != 200:
                result.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                return result
            async for line in reply.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if chunk.get("error"):
                    result.error = str(chunk["error"])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not any(choice.get("text") for choice in chunk.get("choices") or []):
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - started
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e = time.perf_counter() - started
    result.output_tokens = result.output_tokens or chunks  # servers that send no usage: a chunk per token
    return result


async def run(rows: list[dict], url: str, model: str, args) -> tuple[list[Result], float]:
    """Sends every row (at `--concurrency` at a time, or at Poisson arrivals); returns results and
    the wall time."""
    limit = asyncio.Semaphore(args.concurrency or len(rows))
    gaps = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    bar = tqdm(total=len(rows), desc="requests", unit="req")
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        async def one(row: dict) -> Result:
            async with limit:
                result = await send(session, url, request_body(row, model, args.send_text), row)
            bar.update(1)
            return result

        started = time.perf_counter()
        tasks = []
        for row in rows:
            tasks.append(asyncio.create_task(one(row)))
            if args.request_rate:
                await asyncio.sleep(gaps.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    bar.close()
    return results, elapsed


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"mean": statistics.fmean(values), **{f"p{p}": cuts[p - 1] for p in PERCENTILES}}


def summarize(results: list[Result], elapsed: float, args, model: str) -> dict:
    done = [r for r in results if r.error is None]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "base_url": args.base_url, "model": model, "workload": str(args.workload),
        "concurrency": args.concurrency, "request_rate": args.request_rate,
        "requests": len(results), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": elapsed, "requests_per_s": len(done) / elapsed,
        "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / elapsed,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "expected_output_tokens": sum(r.max_tokens for r in done),
        "ttft_s": percentiles([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": percentiles([r.tpot for r in done if r.tpot is not None]),
        "itl_s": percentiles([gap for r in done for gap in r.itl]),
        "e2e_s": percentiles([r.e2e for r in done]),
    }


def print_table(summary: dict) -> None:
    mode = (f"concurrency {summary['concurrency']}" if not summary["request_rate"]
            else f"{summary['request_rate']} req/s Poisson" + (f", concurrency <= {summary['concurrency']}"
                                                              if summary["concurrency"] else ""))
    print(f"\n{summary['model']} at {summary['base_url']}, {mode}: {summary['requests']} requests "
          f"({summary['failed']} failed) in {summary['duration_s']:.1f} s")
    print(f"  {summary['requests_per_s']:.2f} requests/s, {summary['output_tokens_per_s']:.1f} output tokens/s "
          f"({summary['output_tokens']} of {summary['expected_output_tokens']} expected tokens)")
    print(f"  {'ms':<24}{'mean':>10}" + "".join(f"{'p' + str(p):>10}" for p in PERCENTILES))
    for key, name in (("ttft_s", "time to first token"), ("tpot_s", "time per output token"),
                      ("itl_s", "inter-token latency"), ("e2e_s", "end-to-end latency")):
        row = summary[key]
        print(f"  {name:<24}" + "".join(f"{row[k] * 1000:>10.1f}" if row[k] is not None else f"{'-':>10}"
                                        for k in ("mean", *(f"p{p}" for p in PERCENTILES))))
    for error in summary["errors"]:
        print(f"  error: {error}")


def plot(results: list[Result], summary: dict, path: Path) -> bool:
    """Histograms of TTFT, TPOT, ITL and e2e (ms); False if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    done = [r for r in results if r.error is None]
    series = {"time to first token": [r.ttft for r in done if r.ttft is not None],
              "time per output token": [r.tpot for r in done if r.tpot is not None],
              "inter-token latency": [gap for r in done for gap in r.itl],
              "end-to-end latency": [r.e2e for r in done]}
    figure, axes = plt.subplots(1, 4, figsize=(18, 4))
    for axis, (name, values) in zip(axes, series.items()):
        axis.hist([v * 1000 for v in values], bins=40)
        axis.set_title(name)
        axis.set_xlabel("ms")
    axes[0].set_ylabel("count")
    figure.suptitle(f"{summary['model']}: {summary['requests_per_s']:.2f} req/s, "
                    f"{summary['output_tokens_per_s']:.1f} output tok/s")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


async def served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(f"{base_url}/v1/models") as reply:
            reply.raise_for_status()
            return (await reply.json())["data"][0]["id"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--workload", type=Path, required=True, help="JSON Lines: prompt_text, "
                                                                     "prompt_token_ids, max_tokens")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="requests in flight at once (default 1; with --request-rate: no limit)")
    parser.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals, requests/s")
    parser.add_argument("--num-requests", type=int, default=None, help="only the first N lines")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--send-text", action="store_true", help="send prompt_text instead of token ids")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    parser.add_argument("--timeout", type=float, default=600, help="seconds without a byte before giving up")
    parser.add_argument("--result-json", type=Path, default=None,
                        help="default: bench-serving-<concurrency or rate>.json in the current directory")
    parser.add_argument("--plot", type=Path, default=None, help="default: the JSON path with .png")
    args = parser.parse_args(argv)
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 1
    if (args.concurrency is not None and args.concurrency < 1) or (args.request_rate or 1) <= 0:
        parser.error("--concurrency must be >= 1 and --request-rate > 0")
    tag = f"c{args.concurrency}" if not args.request_rate else f"r{args.request_rate:g}"
    args.result_json = args.result_json or Path(f"bench-serving-{tag}.json")
    args.plot = args.plot or args.result_json.with_suffix(".png")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    rows = read_workload(str(args.workload), args.num_requests)
    model = args.model or asyncio.run(served_model(args.base_url, args.api_key))
    results, elapsed = asyncio.run(run(rows, f"{args.base_url}/v1/completions", model, args))
    summary = summarize(results, elapsed, args, model)
    print_table(summary)
    args.result_json.write_text(json.dumps({**summary, "per_request": [dataclasses.asdict(r) for r in results]},
                                           indent=1))
    print(f"  wrote {args.result_json}" + (f" and {args.plot}" if plot(results, summary, args.plot) else
                                           " (no plot: matplotlib is not installed)"))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
