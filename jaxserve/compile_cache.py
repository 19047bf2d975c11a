"""JAX's persistent compilation cache: a second start of the same configuration skips compiling."""

from __future__ import annotations

import os
from pathlib import Path


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxserve" / "xla"


def enable(directory: str | Path | None = None) -> Path:
    """Turns the cache on (every program, however quick to compile); call before building an engine."""
    import jax

    path = Path(directory).expanduser() if directory else default_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
