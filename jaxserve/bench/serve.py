"""Online serving benchmark: replays a workload against any OpenAI-compatible `/v1/completions`.

    jaxserve bench serve --base-url http://127.0.0.1:8000 \
        --workload ../shared/workloads/anchor-64.jsonl --concurrency 8
    jaxserve bench serve ... --request-rate 4          # Poisson arrivals, 4 requests/s

Every request streams, asks for the workload line's `max_tokens` with `ignore_eos: true` and
greedy sampling, so every system makes the same number of tokens (`--eos`: ended by EOS, as
copy-edit.jsonl is meant to be sent; greedy, so every system still makes the same tokens). Per request it measures the
time to first token (TTFT), the time per output token after the first (TPOT), the gaps between
streamed chunks (ITL) and the end-to-end latency; it prints p50/p95/p99 of each, requests/s and
output tokens/s, and writes a JSON result and (with matplotlib) a PNG of the distributions.

Comparing server configurations in one run: each `--launch "FLAGS"` starts
`python -m jaxserve.serve --port 0 FLAGS` in turn (never two at once), waits until it is ready
(compiling is not timed), runs the benchmark, stops it with SIGTERM; a table then compares the
configurations, with ratios against the first:

    jaxserve bench serve --workload ../shared/workloads/shared-prefix.jsonl --concurrency 8 \
        --warmup 1 --launch "--enable-prefix-caching" --launch "--no-enable-prefix-caching"
    jaxserve bench serve --workload ../shared/workloads/shared-prefix.jsonl --scenario long-prompt \
        --launch "--enable-chunked-prefill --max-model-len 2304 --max-num-seqs 16" \
        --launch "--no-enable-chunked-prefill --max-model-len 2304 --max-num-batched-tokens 2304 --max-num-seqs 16"

`--structured json` gives every request a JSON schema of its own (`structured_outputs`; a reply
ends when the model closes the object, so replies are shorter than unconstrained ones);
`--structured regex` a pattern that never completes (`[^"]*`), so that with EOS ignored every reply
runs to max_tokens as an unconstrained one does and the two are compared token for token.
`--compare-plain` replays the workload unconstrained first on the same server and compares the
two (prefix caching off, so that the second replay does not find the first one's prompts cached):

    jaxserve bench serve --workload ../shared/workloads/anchor-64.jsonl --concurrency 16 \
        --structured regex --compare-plain --launch "--no-enable-prefix-caching"

Speculative decoding, with and without, in one run (the table adds its acceptance rate and mean
accepted length, from the server's counters):

    jaxserve bench serve --workload ../shared/workloads/copy-edit.jsonl --eos --concurrency 1 \
        --launch "" --launch "--speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'"

`--scenario long-prompt` measures how long one long prompt stalls running streams instead (see
jaxserve.bench.long_prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from jaxserve.bench import long_prompt
from jaxserve.bench.launch import LaunchedServer, ServerFailedError
from jaxserve.bench.offline import read_workload
from jaxserve.bench.report import PERCENTILES, plot, print_table, print_workload_comparison

COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions",   # jaxserve's, on /metrics
            "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


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


def request_body(row: dict, model: str, send_text: bool, structured: str = "off", eos: bool = False) -> dict:
    body = {"model": model, "prompt": row["prompt_text"] if send_text else row["prompt_token_ids"],
            "max_tokens": row["max_tokens"], "ignore_eos": not eos, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if structured == "json":
        return {**body, "structured_outputs": {"json": row_schema(row)}}
    return {**body, "structured_outputs": {"regex": '[^"]*'}} if structured == "regex" else body


def row_schema(row: dict) -> dict:
    """A JSON schema of the request's own (its id in the field names): every request compiles one."""
    key = f"r{row['id']}"
    return {"type": "object", "required": [f"{key}_title", f"{key}_notes"], "additionalProperties": False,
            "properties": {f"{key}_title": {"type": "string", "maxLength": 40},
                           f"{key}_notes": {"type": "array", "items": {"type": "string"}}}}


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
    headers = auth_headers(args.api_key)
    bar = tqdm(total=len(rows), desc="requests", unit="req")
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        async def one(row: dict) -> Result:
            async with limit:
                result = await send(session, url, request_body(row, model, args.send_text, args.constrained,
                                                               args.eos), row)
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


def summarize(results: list[Result], elapsed: float, args, model: str, base_url: str) -> dict:
    done = [r for r in results if r.error is None]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "base_url": base_url, "model": model, "workload": str(args.workload),
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


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def served_model(base_url: str, api_key: str | None) -> str:
    async with aiohttp.ClientSession(headers=auth_headers(api_key)) as session:
        async with session.get(f"{base_url}/v1/models") as reply:
            reply.raise_for_status()
            return (await reply.json())["data"][0]["id"]


async def server_counters(base_url: str, headers: dict) -> dict[str, float]:
    """jaxserve's cumulative engine counters from /metrics; {} from a server without them."""
    try:
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.get(f"{base_url}/metrics") as reply:
                text = await reply.text() if reply.status == 200 else ""
    except aiohttp.ClientError:
        return {}
    counters: dict[str, float] = {}
    for sample in (s for family in text_string_to_metric_families(text) for s in family.samples):
        name = sample.name.removeprefix("jaxserve:").removesuffix("_total")
        if sample.name.endswith("_total") and name in COUNTERS:
            counters[name] = counters.get(name, 0.0) + sample.value
    return counters


async def bench_workload(base_url: str, model: str, rows: list[dict], args) -> tuple[dict, list[Result]]:
    """`--warmup` untimed requests one at a time (the first rows, one output token each), then the
    timed replay; the server's counters are read around the timed part only."""
    url, headers = f"{base_url}/v1/completions", auth_headers(args.api_key)
    async with aiohttp.ClientSession(headers=headers) as session:
        for row in rows[:args.warmup]:
            warm = await send(session, url, {**request_body(row, model, args.send_text), "max_tokens": 1}, row)
            if warm.error:
                print(f"  warm-up request failed: {warm.error}")
    before = await server_counters(base_url, headers)
    results, elapsed = await run(rows, url, model, args)
    after = await server_counters(base_url, headers)
    summary = summarize(results, elapsed, args, model, base_url)
    summary["warmup_requests"] = min(args.warmup, len(rows))
    summary["server_counters"] = {name: after[name] - before.get(name, 0.0) for name in after}
    return summary, results


def bench_server(base_url: str, rows: list[dict], args, plot_path: Path) -> dict:
    """The chosen scenario against one running server; prints its table, returns its summary
    (with `--compare-plain`: the plain and the constrained replays' summaries, compared)."""
    if args.compare_plain:
        passes = []
        for constrained in ("off", args.structured):
            args.constrained = constrained
            print(f"  -- structured outputs: {constrained}")
            passes.append(bench_server_once(base_url, rows, args, plot_path.with_stem(f"{plot_path.stem}-{constrained}")))
        print_workload_comparison(passes, ["plain", f"constrained ({args.structured})"])
        return {**passes[0], "failed": sum(p["failed"] for p in passes), "structured_passes": passes}
    args.constrained = args.structured
    return bench_server_once(base_url, rows, args, plot_path)


def bench_server_once(base_url: str, rows: list[dict], args, plot_path: Path) -> dict:
    model = args.model or asyncio.run(served_model(base_url, args.api_key))
    if args.scenario == "long-prompt":
        summary = asyncio.run(long_prompt.run(base_url, model, rows, args, auth_headers(args.api_key)))
        long_prompt.print_table(summary)
        return summary
    summary, results = asyncio.run(bench_workload(base_url, model, rows, args))
    print_table(summary)
    print(f"  wrote {plot_path}" if plot(results, summary, plot_path) else "  (no plot: matplotlib is not installed)")
    return {**summary, "per_request": [dataclasses.asdict(r) for r in results]}


def launch_and_bench(index: int, flags: str, rows: list[dict], args) -> dict:
    """Starts a server with `flags`, benchmarks it once ready, stops it."""
    log_path = args.result_json.with_name(f"{args.result_json.stem}-server{index}.log")
    print(f"\n[{index}] python -m jaxserve.serve --port 0 {flags}  (log: {log_path})", flush=True)
    try:
        with LaunchedServer(flags, log_path, args.startup_timeout) as server:
            print(f"[{index}] ready at {server.url} after {server.startup_s:.1f} s (not timed)", flush=True)
            summary = bench_server(server.url, rows, args, args.plot.with_name(f"{args.plot.stem}-{index}.png"))
    except ServerFailedError as error:
        print(f"[{index}] {error}")
        return {"configuration": flags, "failed": 1, "startup_error": str(error)}
    print(f"[{index}] server stopped, exit status {server.returncode}" +
          (f"; its log: {log_path}" if summary["failed"] or server.returncode else ""))
    return {"configuration": flags, "startup_s": server.startup_s, "server_exit_status": server.returncode,
            **summary}


def print_comparison(summaries: list[dict], args) -> None:
    ran = [(f"[{i}] {s['configuration'] or '(defaults)'}", s) for i, s in enumerate(summaries)
           if "startup_error" not in s]
    if ran:
        compare = long_prompt.print_comparison if args.scenario == "long-prompt" else print_workload_comparison
        compare([s for _, s in ran], [label for label, _ in ran])
    for index, summary in enumerate(summaries):
        if "startup_error" in summary:
            print(f"  [{index}] {summary['configuration']}: did not start (see above)")


def _launch_flags(argv: list[str]) -> list[str]:
    """`--launch --some-flag` as `--launch=--some-flag`: argparse takes a lone value that starts
    with '--' for an option of its own."""
    out, argv = [], list(argv)
    while argv:
        arg = argv.pop(0)
        out.append(f"--launch={argv.pop(0)}" if arg == "--launch" and argv else arg)
    return out


def parse_args(argv=None, prog: str = "jaxserve bench serve") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (unless --launch)")
    parser.add_argument("--launch", action="append", metavar="FLAGS", default=None,
                        help="start `python -m jaxserve.serve --port 0 FLAGS` and benchmark it instead of "
                             "--base-url; repeat to compare configurations (one server at a time)")
    parser.add_argument("--startup-timeout", type=float, default=1800, help="seconds a launched server may "
                                                                             "take to become ready")
    parser.add_argument("--scenario", choices=("workload", "long-prompt"), default="workload",
                        help="workload: replay the workload; long-prompt: see jaxserve.bench.long_prompt")
    parser.add_argument("--workload", type=Path, required=True, help="JSON Lines: prompt_text, "
                                                                     "prompt_token_ids, max_tokens")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="requests in flight at once (default 1; with --request-rate: no limit)")
    parser.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals, requests/s")
    parser.add_argument("--num-requests", type=int, default=None, help="only the first N lines")
    parser.add_argument("--warmup", type=int, default=0, help="untimed requests (the first N lines, one "
                                                              "output token each) before timing")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--send-text", action="store_true", help="send prompt_text instead of token ids")
    parser.add_argument("--eos", action="store_true", help="end requests at EOS (default: ignored, so every "
                                                            "request makes its max_tokens)")
    parser.add_argument("--structured", choices=("off", "json", "regex"), default="off",
                        help="constrain every request: a JSON schema each, or a never-ending regex (see above)")
    parser.add_argument("--compare-plain", action="store_true", help="replay unconstrained first and compare")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    parser.add_argument("--timeout", type=float, default=600, help="seconds without a byte before giving up")
    parser.add_argument("--result-json", type=Path, default=None,
                        help="default: bench-serving-<concurrency, rate or scenario>.json here")
    parser.add_argument("--plot", type=Path, default=None, help="default: the JSON path with .png")
    long = parser.add_argument_group("--scenario long-prompt")
    long.add_argument("--streams", type=int, default=8, help="streams decoding when the long prompt arrives")
    long.add_argument("--short-prompt-len", type=int, default=32, help="tokens of each stream's prompt (the "
                                                                        "end of a workload line's)")
    long.add_argument("--stream-max-tokens", type=int, default=None,
                      help="max_tokens of each stream; default 1024 or what max_model_len leaves")
    long.add_argument("--long-prompt-len", type=int, default=2000, help="tokens of the long prompt")
    long.add_argument("--long-max-tokens", type=int, default=16, help="max_tokens of the long prompt")
    long.add_argument("--baseline-s", type=float, default=2.0, help="seconds of decoding before it arrives")
    long.add_argument("--tail-s", type=float, default=2.0, help="seconds of decoding after it finishes")
    args = parser.parse_args(_launch_flags(sys.argv[1:] if argv is None else argv))
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 1
    if (args.concurrency is not None and args.concurrency < 1) or (args.request_rate or 1) <= 0:
        parser.error("--concurrency must be >= 1 and --request-rate > 0")
    if args.compare_plain and args.structured == "off":
        parser.error("--compare-plain needs --structured json or regex")
    if args.streams < 1 or args.short_prompt_len < 1 or args.long_prompt_len < 1 or args.warmup < 0:
        parser.error("--streams, --short-prompt-len and --long-prompt-len must be >= 1, --warmup >= 0")
    tag = (args.scenario if args.scenario != "workload" else
           f"c{args.concurrency}" if not args.request_rate else f"r{args.request_rate:g}")
    args.base_url = args.base_url.rstrip("/")
    args.result_json = args.result_json or Path(f"bench-serving-{tag}.json")
    args.plot = args.plot or args.result_json.with_suffix(".png")
    return args


def _exit_on_sigterm(signum, frame) -> None:
    sys.exit(128 + signum)  # unwinds, so a launched server is stopped (`timeout` sends SIGTERM)


def main(argv=None, prog: str = "jaxserve bench serve") -> int:
    args = parse_args(argv, prog)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.perf_counter()
    rows = read_workload(str(args.workload), args.num_requests)
    if args.launch:
        summaries = [launch_and_bench(index, flags, rows, args) for index, flags in enumerate(args.launch)]
        print_comparison(summaries, args)
        result = {"scenario": args.scenario, "configurations": summaries}
    else:
        summaries = [bench_server(args.base_url, rows, args, args.plot)]
        result = summaries[0]
    args.result_json.write_text(json.dumps(result, indent=1))
    print(f"  wrote {args.result_json} ({time.perf_counter() - started:.0f} s in all, start-ups included)")
    return 1 if any(summary["failed"] for summary in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
