"""Does a server sized by `--gpu-memory-utilization` stay inside its budget under load? (CPU)

    python tools/bench_memory.py --utilization 0.3 --utilization 0.5 --concurrency 16

For each share F it launches `jaxserve serve --gpu-memory-utilization F FLAGS`, replays the
workload through it (`jaxserve bench serve`'s client), and reads the server's resident memory from
/proc while it runs. The budget is F x the host's memory; before the launch the host already uses
some of it (other processes), and the server may use the rest. A table gives, per F: the budget,
what was in use before, the server's peak RSS (VmHWM), the KV pool it logged, and the headroom
(budget - in use before - peak RSS), which must stay >= 0.

    python tools/bench_memory.py --device --utilization 0.5     # on a TPU/GPU (tools/gpu_check.sh)

`--device` checks the same in this process on an accelerator instead: an engine sized by the
share generates the workload, then the device's peak bytes in use (`memory_stats()`) are compared
with the share of its limit.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import threading
import time
from pathlib import Path

from jaxserve.bench import serve as bench_serve
from jaxserve.bench.launch import LaunchedServer
from jaxserve.bench.offline import DEFAULT_WORKLOAD, read_workload
from jaxserve.engine.memory_budget import GIB, host_memory

POOL_LINE = re.compile(r"KV pool: .*?\(([\d.]+) GiB, \w+\), from (.*)")


def _status(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, value = line.split(":", 1)
            if value.strip().endswith("kB"):
                fields[name] = int(value.split()[0]) * 1024
    return fields


def _watch_rss(pid: int, stop: threading.Event, samples: list[int]) -> None:
    while not stop.wait(0.2):
        try:
            samples.append(_status(pid)["VmRSS"])
        except (OSError, KeyError):
            return


def bench(utilization: float, args, rows: list[dict], log_dir: Path) -> dict:
    total, before = host_memory()
    flags = f"--gpu-memory-utilization {utilization} {args.flags}"
    log_path = log_dir / f"server-{utilization:g}.log"
    with LaunchedServer(flags, log_path) as server:
        pid = server.process.pid
        loaded = _status(pid)["VmRSS"]
        samples, stop = [], threading.Event()
        watcher = threading.Thread(target=_watch_rss, args=(pid, stop, samples), daemon=True)
        watcher.start()
        load_args = bench_serve.parse_args(["--workload", str(args.workload), "--concurrency", str(args.concurrency)])
        load_args.constrained = "off"
        model = asyncio.run(bench_serve.served_model(server.url, None))
        results, elapsed = asyncio.run(bench_serve.run(rows, f"{server.url}/v1/completions", model, load_args))
        stop.set()
        watcher.join()
        peak = _status(pid)["VmHWM"]
    pool = POOL_LINE.search(log_path.read_text())
    budget = utilization * total
    return dict(utilization=utilization, budget_gib=budget / GIB, in_use_before_gib=before / GIB,
                rss_loaded_gib=loaded / GIB, rss_peak_gib=peak / GIB, pool_gib=float(pool[1]) if pool else None,
                headroom_gib=(budget - before - peak) / GIB, requests=len(results),
                failed=sum(1 for r in results if r.error), seconds=elapsed)


def on_device(utilization: float, args, rows: list[dict]) -> dict:
    """An engine on the default accelerator sized by `utilization`, loaded with the workload; its
    device's peak memory against the budget."""
    import jax

    from jaxserve import LLM, SamplingParams

    device = jax.devices()[0]
    if not (device.memory_stats() or {}).get("bytes_limit"):
        raise SystemExit(f"{device} reports no memory_stats: --device needs a TPU or GPU")
    llm = LLM(gpu_memory_utilization=utilization, max_model_len=2048, max_num_seqs=args.concurrency)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    started = time.perf_counter()
    llm.generate([row["prompt_token_ids"] for row in rows], params)
    stats = device.memory_stats()
    budget = utilization * stats["bytes_limit"]
    return dict(utilization=utilization, device=str(device), limit_gib=stats["bytes_limit"] / GIB,
                budget_gib=budget / GIB, peak_gib=stats["peak_bytes_in_use"] / GIB,
                headroom_gib=(budget - stats["peak_bytes_in_use"]) / GIB, seconds=time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--utilization", type=float, action="append", default=None, help="repeat (default 0.3)")
    parser.add_argument("--flags", default="--max-model-len 2048", help="the server's other flags")
    parser.add_argument("--workload", type=Path, default=Path(DEFAULT_WORKLOAD))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--device", action="store_true", help="in this process, on a TPU/GPU (see above)")
    args = parser.parse_args()
    rows = read_workload(str(args.workload), args.num_requests)
    if args.device:
        results = [on_device(u, args, rows) for u in args.utilization or [0.9]]
        print(f"{'share':>6} {'device':>12} {'limit':>8} {'budget':>8} {'peak':>8} {'headroom':>9}  (GiB)")
        for r in results:
            print(f"{r['utilization']:>6g} {r['device']:>12} {r['limit_gib']:>8.2f} {r['budget_gib']:>8.2f} "
                  f"{r['peak_gib']:>8.2f} {r['headroom_gib']:>9.2f}")
        return 0 if all(r["headroom_gib"] >= 0 for r in results) else 1
    with tempfile.TemporaryDirectory() as log_dir:
        results = [bench(u, args, rows, Path(log_dir)) for u in args.utilization or [0.3]]
    print(f"\nhost memory {host_memory()[0] / GIB:.2f} GiB; {len(rows)} requests at concurrency {args.concurrency}")
    print(f"{'share':>6} {'budget':>8} {'in use':>8} {'RSS ready':>10} {'RSS peak':>9} {'KV pool':>8} "
          f"{'headroom':>9} {'failed':>7}  (GiB)")
    for r in results:
        print(f"{r['utilization']:>6g} {r['budget_gib']:>8.2f} {r['in_use_before_gib']:>8.2f} "
              f"{r['rss_loaded_gib']:>10.2f} {r['rss_peak_gib']:>9.2f} {r['pool_gib'] or 0:>8.2f} "
              f"{r['headroom_gib']:>9.2f} {r['failed']:>7}")
    return 0 if all(r["headroom_gib"] >= 0 and not r["failed"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
