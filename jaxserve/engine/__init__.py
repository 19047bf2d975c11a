"""The serving engine: how a request becomes tokens.

    LLMEngine.add_request(prompt, SamplingParams)
        tokenises, checks lengths, creates one `Request` per sample (n), queues them
    LLMEngine.step()           launches step N+1 (the first three below), then reads step N back
                               (the rest): async scheduling, so the device runs N+1 meanwhile
        Scheduler.schedule()   picks this step's sequences and how many tokens each computes,
                               under max_num_seqs and max_num_batched_tokens; running requests
                               first, then waiting ones by rank (arrival, or priority); long
                               prompts in chunks; cached prefixes taken from the PageAllocator,
                               which gives pages (copying shared ones before they are written),
                               preempting the worst-ranked request if none are free (where
                               every layer has a window, a sequence's pages behind it go back
                               first); counts the chunks as computed and their samples as
                               placeholders
                               -> one SchedulerOutput
                               speculative decoding: a step of at most disable_by_batch_size
                               decodes gives each one up to K drafts from the Proposer (n-gram
                               lookup, or a draft model's own runner), computed with its last
                               token in a decode slot of 1 + K tokens, sampled after each
        Grammars.fill_masks()  constrained samples (structured outputs, structured_output.py):
                               llguidance fills each one's allowed-token bitmask, in parallel
                               (with drafts, which a draft model samples under the grammar's
                               masks and which are cut to what the grammar allows: one per
                               sampling row, after each draft), combined with allowed_token_ids'
                               masks (which steer and cut drafts too); the SchedulerOutput
                               carries them (token_masks)
        Runner.launch()        picks the smallest compiled shape (bucket) that holds the step
                               (decode-only shapes of 1, 2, 4, ... rows; mixed shapes of 1, 2,
                               4, ... prefill segments: ~12 shapes), builds its padded arrays
                               (batch.py; attention's as ragged rows, which every backend reads)
                               and calls the step's two jitted programs without waiting:
                               logits_step(params, kv_pages, sampled, lora, batch) -> (logits,
                               input tokens, prompt logprobs, kv_pages), kv_pages donated:
                               placeholders take their ids from the step before's tokens
                               (`sampled`, on the device), model forward over the paged KV
                               pool, and for prompt_logprobs requests the logprob of each
                               prompt token (prompt_logprobs.py; skipped by steps without
                               them); then sample_step(logits, input tokens, sampled, sampling)
                               -> (tokens, sampled): the masks first, then bias, penalties (from
                               each penalised sequence's token counts, kept on the device in
                               `sampled` by slot and filled from its history only when its slot
                               is new or stale: penalty_slots.py), temperature, truncation (one
                               program per number of logit rows, which buckets share; over
                               several CPU processes, one program)
        Runner.collect()       waits for step N's tokens
        Scheduler.update()     registers each request's full pages (to its chunk's end) in the prefix
                               cache, appends its token (after drafts, the samples up to the first
                               that differs from its draft: rejection_sampler.py), forks the other
                               samples of a prompt,
                               finishes and frees the pages of requests that hit EOS, a stop id
                               or max_tokens
        matcher.consume_token() moves each constrained sample's grammar on; a complete grammar
                               ends the sample (stop; a run's tokens after it are dropped), a
                               dead end fails its request
        SampleText.add()       extends each sample's text; stop strings end it (without stop
                               strings, its tokens are detokenised only when an output is made)
        Runner.sample()        a step N+1 launched before N's read-back that samples for
                               constrained sequences ran only to its logits (step.logits_step):
                               their masks are filled now, and step.sample_step finishes it
    -> RequestOutput per request that moved (a final-only one: when it finishes; `progress_observer`,
       if set, hears its token counts meanwhile); `step_observer`, if set, gets the step's StepTimes

`AsyncEngine` (async_engine.py) calls step() on a thread of its own and hands each request's
outputs to its `RequestStream` on the event loop. The engine makes a cumulative stream's outputs
as deltas, and the stream adds them up there: the engine thread never copies a whole sample. The
server's streams ask for deltas and send them on as they come (`server.serving.TextDeltas`).

On a mesh with D data slices, `SlicedScheduler` (data_slices.py) holds one Scheduler and
PageAllocator per slice, each on its own part of the pool, and places each new request on the
least-loaded one; the runner lays the slices out side by side. Over several processes, process 0's
runner sends every device call to the others, which replay it (`jaxserve.distributed`).

Host-side modules (request, page_allocator, scheduler, data_slices, scheduler_output,
structured_output, ngram_proposer, rejection_sampler) use no JAX; device work is in batch (array
layout), step, sampler, prompt_logprobs, draft_model and the models package. There are no prefill and decode
phases: every request has `num_computed_tokens`, and a step computes some of what is left.
"""
