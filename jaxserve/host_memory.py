"""Host memory settings for a process that serves: freed memory stays mapped, and the garbage
collector leaves the start-up heap alone and collects young objects less often; and for every
engine, no automatic collection while it compiles its programs.

XLA on CPU allocates each step's temporaries with malloc. glibc serves big blocks with fresh
mmap()s and hands freed memory straight back to the kernel, so every step page-faults and
zeroes its working set again; on SmolLM2 that was a third of a decode step. Serving from the
heap and never trimming it keeps those pages mapped. Linux/glibc only; elsewhere a no-op.

Once the engine is up, the process holds ~600k Python objects (modules, tokenizer, traced
programs) that live as long as it does, and each full collection of the oldest generation walked
them all: 0.52-0.56 s, against 0.03-0.05 s with them frozen (tiny model, an engine built and 256
sequences served). While serving, such a collection comes whenever enough new objects have
outlived the younger ones', and the engine loop stops for it. vLLM freezes its start-up heap too.

Python collects its youngest generation every 700 net allocations of container objects. A step of
256 streams makes several thousand (each request's output, its text, its metrics), so the engine
loop stopped once or twice a step to walk the young objects, and every tenth time the middle
generation too: `tools/bench_host.py --tiny --num-seqs 256 --output-kind delta` counted 118 pauses
in 86 steps, 25-64 ms in all and up to 7 ms each. Every YOUNG_THRESHOLD net allocations instead,
that run paused 0 times: the outputs die young, by reference counting, and never add up to it.

Compiling an engine's programs makes most of those objects (traced programs), and the collector
walked the growing heap over and over meanwhile: the embedded model's engine, from a warm compile
cache, made ~620 collections (4 of them full), and 206 (1 full) with its warm-up under
`collector_paused`, built 0.36-0.50 s sooner. Loading the model is not paused, so that no large
array in a reference cycle outlives its use. A server collects once before it freezes, so that the
garbage of start-up is not frozen with the rest.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import sys
from collections.abc import Iterator

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Tunes glibc malloc for this process; True if it applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all([mallopt(_M_MMAP_MAX, 0), mallopt(_M_TRIM_THRESHOLD, 2**31 - 1), mallopt(_M_TOP_PAD, 64 << 20)])


YOUNG_THRESHOLD = 20_000   # net allocations between collections of the youngest generation (Python: 700)


def freeze_startup_heap() -> None:
    """Moves every object alive now out of the collector's reach for good, and collects young
    objects every YOUNG_THRESHOLD net allocations: call it once, when the process is done starting
    and serves from here on (it is not for a process that builds and drops engines, whose frozen
    objects would never be collected). The garbage left by a start-up without collections
    (`collector_paused`) is collected first, not frozen with the rest."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    log.info("start-up heap frozen: %d objects the garbage collector no longer walks", gc.get_freeze_count())


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic garbage collection inside (an engine compiling its programs: see above); the
    collector is turned back on after, unless it was off before. What became garbage meanwhile
    waits for the next collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
