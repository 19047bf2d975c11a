"""Which LoRA adapters the engine knows, which it keeps in host memory and which sit in device slots.

An adapter is known by its `lora_int_id` (LoRARequest): its name and path. Its weights are read
from disk when a request first names it and kept in host memory, at most `max_cpu_loras` of them,
least recently used dropped first (and read again when needed). `max_loras` device slots (1..)
hold the adapters of the running requests: the scheduler never runs more distinct adapters than
that, and before each step `slots_for` makes the step's adapters resident, overwriting the least
recently used slots that the step does not need. Host bookkeeping only: reading and loading are
the callables the engine gives.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from jaxserve.lora_request import LoRARequest


class LoraAdapters:
    def __init__(self, max_loras: int, max_cpu_loras: int, read: Callable[[str], object],
                 load_slot: Callable[[int, object], None]):
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._read = read            # path -> the adapter's host weights (raises ValueError when bad)
        self._load_slot = load_slot  # (slot, host weights) -> None: writes a device slot
        self.known: dict[int, LoRARequest] = {}
        self._host: collections.OrderedDict[int, object] = collections.OrderedDict()   # LRU last
        self._slots: collections.OrderedDict[int, int] = collections.OrderedDict()    # id -> slot, LRU last
        self.num_slot_loads = 0

    def register(self, request: LoRARequest) -> int:
        """Reads (and checks) `request`'s adapter unless known; its id. Raises ValueError."""
        known = self.known.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id={request.lora_int_id} is already adapter {known.lora_name!r} at "
                             f"{known.lora_path!r}; another adapter needs another id")
        self._weights(request.lora_int_id, request.lora_path)
        self.known[request.lora_int_id] = request
        return request.lora_int_id

    def name(self, lora_id: int) -> str:
        return self.known[lora_id].lora_name

    def slots_for(self, lora_ids: Iterable[int]) -> dict[int, int]:
        """Each of `lora_ids` (0: none) in a device slot, loading those that are not resident."""
        wanted = [i for i in dict.fromkeys(lora_ids) if i]
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step with {len(wanted)} adapters, more than max_loras={self.max_loras}")
        for lora_id in wanted:
            if lora_id in self._slots:
                self._slots.move_to_end(lora_id)
                continue
            used = set(self._slots.values())
            free = [s for s in range(1, self.max_loras + 1) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self._slots if i not in wanted)
                slot = self._slots.pop(victim)
            self._load_slot(slot, self._weights(lora_id, self.known[lora_id].lora_path))
            self.num_slot_loads += 1
            self._slots[lora_id] = slot
        return {i: self._slots[i] for i in wanted}

    def forget(self, lora_id: int) -> None:
        """An unloaded adapter: gone from host memory and its slot (its running requests finish first)."""
        self.known.pop(lora_id, None)
        self._host.pop(lora_id, None)
        self._slots.pop(lora_id, None)

    def _weights(self, lora_id: int, path: str):
        if lora_id in self._host:
            self._host.move_to_end(lora_id)
            return self._host[lora_id]
        weights = self._read(path)
        self._host[lora_id] = weights
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return weights
