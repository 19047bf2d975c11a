"""Block sizes for the ragged paged attention kernels, one row per device kind.

Every entry is correct on every device (the kernels clamp blocks to the call's shapes); the table
only chooses speed. Lookup matches a key as a case-insensitive substring of
`jax.Device.device_kind` ("TPU v5 lite", "TPU v6 lite", "NVIDIA H100 80GB HBM3", "NVIDIA H200",
"cpu"); the first match wins, so specific keys come before general ones. The TPU and GPU rows
are starting points chosen from the hardware's VMEM/SMEM sizes, not yet measured (run
tools/bench_kernels.py there and adjust); the cpu row was measured in interpret mode.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Knobs of both kernel variants; hashable, so it can be a static argument of `jax.jit`."""

    # TPU: tokens per query block (its rows are tokens * heads-per-KV-head, rounded up to whole
    # sublane tiles); decode-like batches (tokens <= 2 * sequences) use the smaller one, since
    # every sequence of a block is computed over all the block's rows.
    q_block_tokens: int = 32
    decode_q_block_tokens: int = 4
    # Both: KV tokens per compute block (TPU: rounded down to whole pages, at least one page;
    # GPU: a power of two >= 16, pages gathered row by row).
    kv_block_tokens: int = 128
    # TPU: KV heads per program (None: all, one DMA per page carries every head).
    kv_heads_per_block: int | None = None
    # GPU: query rows (token x head) per program, powers of two >= 16; decode-like batches
    # (tokens <= 2 * sequences) use the smaller one, so that more programs share the work.
    gpu_block_rows: int = 64
    gpu_decode_block_rows: int = 16
    gpu_num_warps: int = 4
    gpu_num_stages: int = 2
    # GPU write_kv: tokens per program (a power of two >= 16).
    write_block_tokens: int = 64

    def __post_init__(self):
        for name in ("q_block_tokens", "decode_q_block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("kv_block_tokens", "gpu_block_rows", "gpu_decode_block_rows", "write_block_tokens"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        if self.kv_heads_per_block is not None and self.kv_heads_per_block < 1:
            raise ValueError(f"kv_heads_per_block={self.kv_heads_per_block} must be >= 1 or None")


DEFAULT = Tuning()

# (device-kind substring, tuning), most specific first.
TABLE: tuple[tuple[str, Tuning], ...] = (
    # One TensorCore, 16 MiB default scoped VMEM: moderate blocks.
    ("TPU v5 lite", Tuning(q_block_tokens=32, kv_block_tokens=128)),
    ("TPU v5e", Tuning(q_block_tokens=32, kv_block_tokens=128)),
    # 32 MiB scoped VMEM and a faster MXU: larger KV blocks amortise the per-block overhead.
    ("TPU v6", Tuning(q_block_tokens=64, kv_block_tokens=256)),
    ("TPU", Tuning(q_block_tokens=32, kv_block_tokens=128)),
    ("H200", Tuning(kv_block_tokens=64, gpu_block_rows=64, gpu_num_warps=4, gpu_num_stages=3)),
    ("H100", Tuning(kv_block_tokens=64, gpu_block_rows=64, gpu_num_warps=4, gpu_num_stages=3)),
    # Interpret mode: the interpreter's cost grows with loop trips, not with block size.
    ("cpu", Tuning(q_block_tokens=256, decode_q_block_tokens=256, kv_block_tokens=256,
                   gpu_block_rows=256, gpu_decode_block_rows=64, write_block_tokens=1024)),
)


def tuning_for(device_kind: str | None = None) -> Tuning:
    """The table's entry for `device_kind` (default: the first local device's), else DEFAULT."""
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    kind = device_kind.lower()
    for key, tuning in TABLE:
        if key.lower() in kind:
            return tuning
    return DEFAULT
