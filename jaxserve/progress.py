"""A tqdm progress bar behind the `progress(done, total)` callback the engine reports warm-up with."""

from __future__ import annotations

from collections.abc import Callable


def progress_bar(description: str, unit: str = "program") -> Callable[[int, int], None]:
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=description, unit=unit)
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    return update
