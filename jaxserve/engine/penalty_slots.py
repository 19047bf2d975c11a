"""Which slot of the device's penalty counts holds each penalised sequence's counts (host side).

Penalties read how often each token occurs among a sequence's outputs and whether its prompt holds
it. The device keeps these counts by slot (`sampler.Sampled.counts`), so a step sends no token
history for a sequence whose slot is current: the step that first samples for it sends its history
once and its slot is filled from it, and every sample after is added there on the device (a
placeholder's too, before the host has read it). A slot is current while it has counted exactly
the outputs the sequence has so far (`ScheduledSequence.num_output_tokens`); otherwise it is filled
anew from the history: a preempted sequence's dropped placeholder, a slot taken by another sequence.
A sequence with drafts samples at several rows, each as if some drafts were its outputs, and only
the host learns which are kept: each such row takes a slot of its own for the step, filled from its
history, and counts nothing. A draft model's runner counts its own proposals, which the target may
reject: its proposer releases a sequence's slot before each proposal (`release`), so the first draft
is sampled from counts filled anew and each one after from those plus the drafts before it.

Slots are taken least recently used first. A step has at most as many sampling rows as there are
slots (`Runner`), so a slot a step uses is never taken by another row of the same step.
"""

from __future__ import annotations

from collections import OrderedDict


class PenaltySlots:
    """The slots of one runner's `Sampled.counts`, given to the penalised rows of each step it builds."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        # key -> [slot, outputs counted there], least recently used first; a key is a sequence's id,
        # or (id, output index) for a row with drafts, whose count (-1) is never current
        self._owners: OrderedDict[object, list[int]] = OrderedDict()
        self._free = list(range(num_slots))

    def slot_for(self, row) -> tuple[int, bool, bool]:
        """(slot, whether to fill it from the row's history, whether to add the row's sample to it)
        for a penalised sampling row (a `ScheduledSequence`, or `batch.draft_row`'s copy of one)."""
        n = row.num_output_tokens
        if row.draft_token_ids:
            return self._take((row.request_id, n), -1), True, False
        owner = self._owners.get(row.request_id)
        if owner is not None and owner[1] == n:
            self._owners.move_to_end(row.request_id)
            owner[1] = n + 1
            return owner[0], False, True
        return self._take(row.request_id, n + 1), True, True

    def release(self, request_id: str) -> None:
        """Frees `request_id`'s slot, if it has one: its counts are no longer its outputs'."""
        owner = self._owners.pop(request_id, None)
        if owner is not None:
            self._free.append(owner[0])

    def _take(self, key, counted: int) -> int:
        """A slot for `key` (its own if it has one) that will have counted `counted` outputs."""
        owner = self._owners.pop(key, None)
        if owner is not None:
            slot = owner[0]
        elif self._free:
            slot = self._free.pop()
        else:
            slot = self._owners.popitem(last=False)[1][0]
        self._owners[key] = [slot, counted]
        return slot
