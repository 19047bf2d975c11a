"""How many bytes the KV pool may take: vLLM's `--gpu-memory-utilization` rule, per device.

    pool bytes per device = utilization x the device's limit - bytes in use after loading (the
                            weights and anything else) - the largest step's temporaries

over a mesh the smallest figure decides, since every device holds the same share of the pool.
TPUs and GPUs report their limit and use (`Device.memory_stats()`: `bytes_limit`, `bytes_in_use`;
on GPU the limit is XLA's allocator pool, by default 75% of the card). CPU devices report nothing:
they share the host's memory (`/proc/meminfo`: `MemTotal`, less `MemAvailable` in use), which is
split evenly between them, and there the compiled programs and XLA's compile scratch, made after
the pool is sized, come out of the same memory: `HOST_RESERVE` is kept back for them (measured
with tools/bench_memory.py: SmolLM2's 13 programs took 0.65 GiB and serving 0.2 GiB more). The
arithmetic takes plain numbers, so it is tested with made-up devices.
"""

from __future__ import annotations

import dataclasses

GIB = 2**30
HOST_RESERVE = GIB   # on the host: compiled programs and compile scratch, made after the pool is sized


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    name: str
    limit: int     # bytes this device may use
    in_use: int    # bytes in use now
    reserve: int = 0   # bytes to keep back for what comes after sizing (on the host: HOST_RESERVE's share)


@dataclasses.dataclass(frozen=True)
class PoolBudget:
    utilization: float
    device: DeviceMemory       # the device that decides (the one with the least room)
    step_bytes: int            # the largest step's temporaries, per device
    per_device: int            # pool bytes each device may hold
    num_devices: int

    @property
    def total(self) -> int:
        """Pool bytes over all devices: each holds the same share (pages over `data`, heads over `model`)."""
        return self.per_device * self.num_devices

    def describe(self) -> str:
        d = self.device
        reserve = f" - {d.reserve / GIB:.2f} GiB kept for compiled programs" if d.reserve else ""
        return (f"{self.utilization:g} x {d.limit / GIB:.2f} GiB ({d.name}) - {d.in_use / GIB:.2f} GiB in use{reserve}"
                f" - {self.step_bytes / GIB:.3f} GiB for the largest step = {self.per_device / GIB:.2f} GiB per device"
                f", x {self.num_devices} device{'s' if self.num_devices > 1 else ''} = {self.total / GIB:.2f} GiB")


def pool_budget(devices: list[DeviceMemory], utilization: float, step_bytes: int) -> PoolBudget:
    """The pool's bytes under `utilization`; raises ValueError, with the numbers, if nothing is left."""
    room = {d.name: int(utilization * d.limit) - d.in_use - d.reserve - step_bytes for d in devices}
    tightest = min(devices, key=lambda d: room[d.name])
    budget = PoolBudget(utilization, tightest, step_bytes, room[tightest.name], len(devices))
    if budget.per_device <= 0:
        raise ValueError(f"no memory is left for the KV cache: {budget.describe()}; raise "
                         f"--gpu-memory-utilization (now {utilization:g}, at most 1), or give the pool's size "
                         f"with --kv-cache-memory-bytes or --num-pages")
    return budget


def host_memory(path: str = "/proc/meminfo") -> tuple[int, int]:
    """(total, in use) bytes of this host: MemTotal and MemTotal - MemAvailable."""
    fields = {}
    with open(path) as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024   # kB
    return fields["MemTotal"], fields["MemTotal"] - fields["MemAvailable"]


def device_memory(devices) -> list[DeviceMemory]:
    """Each device's limit and use: its own `memory_stats()`, or for devices that report none (CPU)
    an even share of the host's memory."""
    stats = [d.memory_stats() for d in devices]
    if all(s and "bytes_limit" in s for s in stats):
        return [DeviceMemory(str(d), int(s["bytes_limit"]), int(s["bytes_in_use"])) for d, s in zip(devices, stats)]
    total, in_use = host_memory()
    share = len(devices)
    where = "host memory" if share == 1 else f"host memory / {share} devices"
    return [DeviceMemory(f"{d}, {where}", total // share, in_use // share, HOST_RESERVE // share) for d in devices]
