"""Turns a `SchedulerOutput` into the padded arrays of one step, for one compiled shape (bucket).

Packed token layout, `T = Gd * L + Gp * segment`:
  [0, Gd L) a slot of L tokens for each decode (a sequence computing a single token, or with
            speculative drafts its last token and the drafts), padded; L is 1 without drafts
  [Gd L, T) `Gp` segments of `segment` tokens; each multi-token chunk fills whole segments,
            its last one padded
Logit rows, `S` (`BatchLayout.num_logit_rows`): one per decode's token, then one per prefill
sequence that samples, then padding; `Gd * L + Gp`, or fewer where a step holds fewer sequences,
rounded up to a power of two, so that buckets of one size share one sampling program. A decode with
drafts samples at each of its tokens (the target's token after each).
Prompt rows, `T`: the packed index of each prompt token scored for prompt_logprobs and the prompt
token it predicts, sequence after sequence (`prompt_rows` says whose), then padding (target -1).
Padding tokens sit at position -1 and write their K/V into the reserved page 0.
Attention reads the tokens as ragged rows (`RaggedRows`, every backend's one contract): a row per
sequence's chunk in packed order, with its context length and block table, and a row of padding
over each gap.
A placeholder token (async scheduling: the sample of the step launched before, still on the
device) has token id 0 and, in `placeholder_rows`, the logit row of that step that sampled it.

Over D data slices, each slice's sequences are laid out as above in the same bucket, with page ids
local to the slice, and the D layouts are concatenated on every array's leading axis (the mesh
splits them there); logit row indices count from the start of the whole batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np
from flax import struct

from jaxserve.engine.penalty_slots import PenaltySlots
from jaxserve.engine.sampler import SamplingTensors, sampling_tensors
from jaxserve.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from jaxserve.models.layers.attention import AttentionMetadata, RaggedRows


@struct.dataclass
class StepInput:
    token_ids: np.ndarray          # [T] int32
    attention: AttentionMetadata
    logits_index: np.ndarray       # [S] int32: packed index of each scored token
    sampling: SamplingTensors      # [S] rows
    prompt_index: np.ndarray       # [T] int32: packed index of each prompt token scored (prompt_logprobs)
    prompt_target: np.ndarray      # [T] int32: the prompt token it predicts; -1: padding
    placeholder_rows: np.ndarray   # [T] int32: the previous step's logit row whose sample is this
                                   # token (a placeholder); -1: token_ids holds it
    lora_slots: np.ndarray         # [T] int32: the LoRA slot of the token's adapter; 0: none


@dataclasses.dataclass(frozen=True)
class Bucket:
    num_decode: int      # Gd
    num_segments: int    # Gp
    decode_len: int = 1  # L: tokens per decode slot (1 + speculative drafts)

    def num_tokens(self, segment: int) -> int:
        return self.num_decode * self.decode_len + self.num_segments * segment


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Fixed sizes of every step's arrays."""

    page_size: int
    segment: int              # prefill queries per attention segment
    pages_per_chunk: int      # pages visited per attention loop iteration
    table_width: int          # block table entries per row, a multiple of pages_per_chunk
    vocab_size: int
    history_width: int        # token history per sampled row (penalties): the context length
    max_num_seqs: int = 0     # sequences a step holds at most (per slice); 0: one per decode slot and segment

    def num_logit_rows(self, bucket: Bucket) -> int:
        """A row per decode slot's token and per segment (a prompt's chunk samples after its last),
        but no more than `max_num_seqs` decodes' worth, rounded up to a power of two: buckets with
        as many share one sampling program (the 12 shapes of the defaults: 6). The cap: a mixed
        bucket has more decode slots and segments than a step holds sequences, and the tiny
        model's mixed steps at 256 sequences took 40-55 ms longer with their 272 rows padded to 512."""
        rows = bucket.num_decode * bucket.decode_len + bucket.num_segments
        if self.max_num_seqs:
            rows = min(rows, self.max_num_seqs * bucket.decode_len)
        return 1 << (rows - 1).bit_length()

    def needs(self, output: SchedulerOutput, num_slices: int = 1) -> Bucket:
        """The smallest sizes that hold this step in every slice: decode slots and prefill segments."""
        decode, segments, decode_len = [0] * num_slices, [0] * num_slices, 1
        for s in output.sequences:   # is_decode inline: a call a sequence, here and in build, took ~0.1 ms of 256
            num_tokens = len(s.token_ids)
            if num_tokens == 1 or s.draft_token_ids:
                decode[s.data_slice] += 1
                decode_len = max(decode_len, num_tokens)
            else:
                segments[s.data_slice] += -(-num_tokens // self.segment)
        return Bucket(max(decode), max(segments), decode_len)

    def build(self, output: SchedulerOutput, bucket: Bucket, num_slices: int = 1,
              previous_rows: Mapping[str, int] | None = None, penalty_slots: PenaltySlots | None = None
              ) -> tuple[StepInput, list[ScheduledSequence | None]]:
        """Arrays for `bucket` in each of `num_slices` slices, and the sequence sampled at each
        logit row (None: padding). `previous_rows`: the logit row of each sequence sampled by the
        step launched before, for the placeholders. `penalty_slots`: the device's penalty counts
        (see `sampling_tensors`), given a slot for each penalised row of the step."""
        previous_rows = previous_rows or {}
        if num_slices == 1:
            return self._build_slice(output.sequences, bucket, output.token_masks, previous_rows, output.lora_slots,
                                     penalty_slots)
        by_slice = [[] for _ in range(num_slices)]
        for s in output.sequences:
            by_slice[s.data_slice].append(s)
        slice_tokens = bucket.num_tokens(self.segment)
        inputs, rows = [], []
        for i, sequences in enumerate(by_slice):
            step, slice_rows = self._build_slice(sequences, bucket, output.token_masks, previous_rows,
                                                 output.lora_slots, penalty_slots)
            inputs.append(step.replace(logits_index=step.logits_index + i * slice_tokens,
                                       prompt_index=step.prompt_index + i * slice_tokens))
            rows += slice_rows
        return jax.tree.map(lambda *parts: np.concatenate(parts), *inputs), rows

    def _build_slice(self, sequences, bucket: Bucket, token_masks, previous_rows: Mapping[str, int],
                     lora_slots: Mapping[str, int] | None, penalty_slots: PenaltySlots | None
                     ) -> tuple[StepInput, list[ScheduledSequence | None]]:
        gd, gp, seg, ps = bucket.num_decode, bucket.num_segments, self.segment, self.page_size
        dl, num_tokens, num_rows = bucket.decode_len, bucket.num_tokens(seg), self.num_logit_rows(bucket)
        token_ids = np.zeros(num_tokens, np.int32)
        positions = np.full(num_tokens, -1, np.int32)
        slots = np.arange(num_tokens, dtype=np.int32) % ps  # padding writes into page 0
        ragged = _RaggedRows(bucket, self.table_width)
        logits_index = np.zeros(num_rows, np.int32)
        prompt_index = np.zeros(num_tokens, np.int32)
        prompt_target = np.full(num_tokens, -1, np.int32)
        placeholder_rows = np.full(num_tokens, -1, np.int32)
        token_lora_slots = np.zeros(num_tokens, np.int32)
        scored = 0   # prompt rows filled
        rows: list[ScheduledSequence | None] = [None] * num_rows
        decodes = [s for s in sequences if len(s.token_ids) == 1 or s.draft_token_ids]   # is_decode
        others = [s for s in sequences if len(s.token_ids) > 1 and not s.draft_token_ids] \
            if len(decodes) < len(sequences) else []
        next_prefill_row = len(decodes) * dl   # the rows of the decodes' tokens, then the prompts'
        if next_prefill_row + sum(s.samples for s in others) > num_rows:
            raise ValueError(f"a step of {len(decodes)} decodes and {len(others)} prompt chunks exceeds the "
                             f"{num_rows} logit rows of bucket {bucket}")
        if _single_tokens(decodes):
            # The usual step: one token each. Laid out a column at a time, in the order the loop
            # below would give them rows (256 decodes: ~4 ms row by row, ~0.5 ms by columns).
            at = np.arange(len(decodes), dtype=np.int32) * dl
            pos = np.array([s.start_position for s in decodes], np.int32)
            token_ids[at] = [s.token_ids[0] for s in decodes]
            positions[at] = pos
            decode_rows = ragged.add_decodes([s.block_table for s in decodes], pos + 1, dl)
            slots[at] = ragged.block_tables[decode_rows, pos // ps] * ps + pos % ps
            placeholders = [i for i, s in enumerate(decodes) if s.placeholder]
            previous = [previous_rows.get(decodes[i].request_id) for i in placeholders]
            if None in previous:
                raise _not_sampled_before(decodes[placeholders[previous.index(None)]])
            placeholder_rows[at[placeholders]] = previous
            sampled = [i for i, s in enumerate(decodes) if s.samples]
            if len(sampled) == len(decodes):   # the usual step: every decode samples
                logits_index[at] = at
                rows[:len(decodes) * dl:dl] = decodes
            else:
                logits_index[at[sampled]] = at[sampled]
                for i in sampled:
                    rows[i * dl] = decodes[i]
            if lora_slots:
                token_lora_slots[at] = [lora_slots.get(s.request_id, 0) for s in decodes]
            sequences = others
        chunks = []   # (first packed token, tokens, context length, pages) of each sequence, for its ragged row
        used_decodes = used_segments = 0
        for s in sequences:
            table = np.asarray(s.block_table, np.int32)
            pos = s.start_position + np.arange(s.num_tokens, dtype=np.int32)
            if is_decode(s):
                row = used_decodes * dl
                at = row + np.arange(s.num_tokens)
                used_decodes += 1
            else:
                at = gd * dl + used_segments * seg + np.arange(s.num_tokens)
                used_segments += -(-s.num_tokens // seg)
                row = next_prefill_row
                next_prefill_row += s.samples
            chunks.append((int(at[0]), s.num_tokens, s.start_position + s.num_tokens, table))
            token_ids[at] = s.token_ids
            if s.placeholder:
                placeholder_rows[at[0]] = _previous_row(s, previous_rows)
            positions[at] = pos
            slots[at] = table[pos // ps] * ps + pos % ps
            if lora_slots:
                token_lora_slots[at] = lora_slots.get(s.request_id, 0)
            if s.draft_token_ids:   # a sample after the last real token and after each draft
                first = s.num_tokens - len(s.draft_token_ids) - 1
                for i in range(len(s.draft_token_ids) + 1):
                    logits_index[row + i] = at[first + i]
                    rows[row + i] = draft_row(s, i)
            elif s.samples:
                logits_index[row] = at[-1]
                rows[row] = s
            targets = s.prompt_targets
            prompt_index[scored:scored + len(targets)] = at[:len(targets)]
            prompt_target[scored:scored + len(targets)] = targets
            scored += len(targets)
        for chunk in sorted(chunks, key=lambda chunk: chunk[0]):   # decode slots first, then segments
            ragged.add(*chunk)
        attention = AttentionMetadata(positions=positions, slot_mapping=slots, ragged=ragged.done(), num_decode=gd,
                                      num_segments=gp, decode_len=dl)
        sampling = sampling_tensors(rows, num_rows, self.vocab_size, self.history_width, token_masks, penalty_slots)
        return StepInput(token_ids, attention, logits_index, sampling, prompt_index, prompt_target,
                         placeholder_rows, token_lora_slots), rows

    def prompt_rows(self, output: SchedulerOutput, bucket: Bucket, num_slices: int = 1) -> list[tuple[str, int, int]]:
        """(sequence id, position, prompt row) of each prompt token `build` lays out for scoring."""
        slice_tokens = bucket.num_tokens(self.segment)
        found = []
        for i in range(num_slices):
            row = i * slice_tokens
            for s in output.sequences:
                if s.prompt_targets and (num_slices == 1 or s.data_slice == i):   # few have them
                    found += [(s.request_id, s.start_position + j, row + j) for j in range(len(s.prompt_targets))]
                    row += len(s.prompt_targets)
        return found


def _single_tokens(decodes: list[ScheduledSequence]) -> bool:
    """Every decode slot holds one token and scores no prompt (no drafts): laid out by columns."""
    return not any(len(s.token_ids) > 1 or s.prompt_targets for s in decodes)


def _previous_row(s: ScheduledSequence, previous_rows: Mapping[str, int]) -> int:
    """The logit row of the step before that sampled `s`'s placeholder."""
    if s.request_id not in previous_rows:
        raise _not_sampled_before(s)
    return previous_rows[s.request_id]


def _not_sampled_before(s: ScheduledSequence) -> ValueError:
    return ValueError(f"{s.request_id} has a placeholder, but the step before did not sample it")


def is_decode(s: ScheduledSequence) -> bool:
    """Laid out in a decode slot: a single token, or a last token and its drafts."""
    return s.num_tokens == 1 or bool(s.draft_token_ids)


def draft_row(s: ScheduledSequence, i: int) -> ScheduledSequence:
    """The sampling row of a sequence with drafts after its first `i` drafts: its token index and,
    when it is penalised, its output as if those drafts were its tokens."""
    if i == 0:
        return s
    history = np.concatenate((np.asarray(s.history, np.int32), np.asarray(s.draft_token_ids[:i], np.int32))) \
        if s.params.penalizes else ()
    return dataclasses.replace(s, num_output_tokens=s.num_output_tokens + i, history=history)


class _RaggedRows:
    """The step's `RaggedRows`, filled in packed order."""

    def __init__(self, bucket: Bucket, table_width: int):
        # At most: a row per decode slot and one over the padding after each when the slots hold
        # drafts (L > 1), and a row per prompt chunk and one over the gap before each (Gp at most)
        max_rows = bucket.num_decode * (1 if bucket.decode_len == 1 else 2) + 2 * bucket.num_segments + 1
        self.block_tables = np.zeros((max_rows, table_width), np.int32)
        self.kv_lens = np.zeros(max_rows, np.int32)
        self.cu_q_lens = np.zeros(max_rows + 1, np.int32)
        self.used = 0

    def add_decodes(self, tables: list, kv_lens: np.ndarray, decode_len: int) -> np.ndarray:
        """The first rows: single-token decodes in slots 0, 1, ..., a row of padding between two
        when a slot is longer (L > 1). Returns each decode's row."""
        n, step = len(tables), 1 if decode_len == 1 else 2
        rows = np.arange(n) * step
        if n:   # the tables at once: row by row took ~0.15 ms of 256 decodes
            widths = np.array([len(table) for table in tables])
            entries = np.concatenate(tables)
            firsts = np.repeat(np.cumsum(widths) - widths, widths)   # each entry's table's first, in `entries`
            self.block_tables[np.repeat(rows, widths), np.arange(len(entries)) - firsts] = entries
        self.kv_lens[rows] = kv_lens
        starts = np.arange(n, dtype=np.int32) * decode_len
        ends = np.empty(max(step * n - step + 1, 0), np.int32)   # each row's end: a decode's, then its padding's
        ends[0::step] = starts + 1
        if step == 2:
            ends[1::2] = starts[1:]
        self.cu_q_lens[1:len(ends) + 1] = ends
        self.used = len(ends)
        return rows

    def add(self, start: int, num_tokens: int, kv_len: int, table: np.ndarray) -> None:
        row = self.used
        if start > self.cu_q_lens[row]:   # padding before it
            self.cu_q_lens[row + 1] = start
            row += 1
        self.block_tables[row, :len(table)] = table
        self.kv_lens[row] = kv_len
        self.cu_q_lens[row + 1] = start + num_tokens
        self.used = row + 1

    def done(self) -> RaggedRows:
        self.cu_q_lens[self.used + 1:] = self.cu_q_lens[self.used]
        return RaggedRows(self.block_tables, self.kv_lens, self.cu_q_lens, np.array([self.used], np.int32))
