"""A decode replica's step, and the hand-off that feeds it.

Continuous batching as the engine schedules a step: every decoding request one token, then
prompts part-way, then the queue in order, while blocks and max_num_seqs allow. KV capacity in
blocks; when a decode needs a block and none is free, the most recently admitted request not yet
scheduled in the step is preempted by recompute (blocks freed, back to the queue's head, its
prompt + output recomputed later). A step mixing decodes and prompt chunks (local prefill) is one
forward over all its rows (`Profile.mixed_step`); a step with decodes carries the serving path's
measured cost per decode step and per stream (profile.serving). A prompt prefilled remotely reaches the decode queue after its
transfer (the profile's or the plan's `Transfer`, plus the serving path's hand-off).
"""

from __future__ import annotations

from cluster.planner.sim.events import TRANSFERRED
from cluster.planner.sim.prefill import chunk_shape
from cluster.planner.sim.state import Replica, SimRequest


class DecodeSteps:
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _schedule_decode(self, rep: Replica):
        decodes, chunks = [], []
        decoding = [x for x in rep.running if x.known - x.computed == 1]
        short = [x for x in decoding if x.computed >= x.blocks * self.block_size]  # need one more block
        if len(short) <= rep.free_blocks:  # the common case: every decode fits
            for r in short:
                r.blocks += 1
            rep.free_blocks -= len(short)
            decodes = decoding
            scheduled = set(map(id, decoding))
        else:
            scheduled = self._decodes_preempting(rep, decoding, decodes)
        budget = self.config.chunk_tokens - len(decodes)
        for r in rep.running:  # (2) prompts part-way
            if budget <= 0:
                break
            if r.known - r.computed > 1 and id(r) not in scheduled:
                take = self._fit_chunk(rep, r, budget)
                if take == 0:
                    break
                chunks.append((r, take))
                budget -= take
        self._admit_queue(rep, budget, decodes, chunks)
        if not decodes and not chunks:
            return None
        return self._step_seconds(decodes, chunks), (decodes, chunks)

    def _step_seconds(self, decodes: list, chunks: list) -> float:
        """A decode replica's step: the decode curve, the prefill curve, or one forward of both."""
        if not decodes:
            return self._prefill_seconds(chunks)
        n = len(decodes)
        ctx = sum(r.computed for r in decodes) / n + 1
        serving = self.serving_step_s + self.serving_stream_s * n
        if not chunks:
            return self.profile.decode(n, ctx) + serving
        return self.profile.mixed_step(*chunk_shape(chunks), n, ctx) + serving

    def _admit_queue(self, rep: Replica, budget: int, decodes: list, chunks: list) -> None:
        """(3) the queue, in order, while the token budget, max_num_seqs and the blocks allow."""
        while budget > 0 and rep.waiting and len(rep.running) < self.config.max_num_seqs:
            r = rep.waiting[0]
            if r.known - r.computed == 1:  # imported from prefill: its whole prompt's KV arrives
                need = self._blocks_for(r.computed + 1)
                if need > rep.free_blocks:
                    break
                rep.waiting.popleft()
                rep.running.append(r)
                self._grow(rep, r, need)
                decodes.append(r)
                budget -= 1
            else:
                take = self._fit_chunk(rep, r, budget)
                if take == 0:
                    break
                rep.waiting.popleft()
                rep.running.append(r)
                chunks.append((r, take))
                budget -= take

    def _decodes_preempting(self, rep: Replica, decoding: list, decodes: list) -> set:
        """Blocks ran out: in admission order, each decode that needs a block preempts the most
        recently admitted request not yet scheduled in this step (itself, if it is that one)."""
        scheduled, preempted = set(), set()
        for r in decoding:
            if id(r) in preempted:  # for an older request, earlier in this loop
                continue
            need = self._blocks_for(r.computed + 1) - r.blocks
            while need > rep.free_blocks:
                victim = next(v for v in reversed(rep.running) if id(v) not in scheduled)
                self._preempt(rep, victim)
                preempted.add(id(victim))
                if victim is r:
                    break
            else:
                self._grow(rep, r, need)
                decodes.append(r)
                scheduled.add(id(r))
        return scheduled

    def _fit_chunk(self, rep: Replica, r: SimRequest, budget: int) -> int:
        """Prompt tokens of r this step: as many as the budget and the free blocks allow."""
        take = min(r.known - r.computed, budget)
        room = (r.blocks + rep.free_blocks) * self.block_size - r.computed
        take = min(take, room)
        if take <= 0:
            return 0
        self._grow(rep, r, self._blocks_for(r.computed + take) - r.blocks)
        return take

    def _grow(self, rep: Replica, r: SimRequest, n: int) -> None:
        rep.free_blocks -= n
        r.blocks += n

    def _preempt(self, rep: Replica, r: SimRequest) -> None:
        rep.running.remove(r)
        rep.free_blocks += r.blocks
        r.blocks = 0
        if r.in_prompt:  # what it had left to compute is counted again, whole, below
            rep.prompt_tokens_left -= r.known - r.computed
            r.in_prompt = False
        r.computed = 0  # recompute: prompt and output so far, as a prompt
        rep.queue(r, front=True)
        self.preemptions += 1

    def _decode_done(self, rep: Replica, work) -> int:
        """The step's tokens are computed; returns the tokens sampled."""
        decodes, chunks = work
        now, itl = self.now, self.itl
        ended, sampled = [], len(decodes)
        for r in decodes:  # inline: the simulator's hottest loop (one pass per token)
            r.computed += 1
            if r.in_prompt:  # a prompt's last token, computed as a decode
                rep.prompt_tokens_left -= 1
                r.in_prompt = False
            if r.generated == 0:  # a one-token prompt prefilled here
                self._sample(r)
            else:
                r.generated += 1
                r.known += 1
                itl.append(now - r.last_token_s)
                r.last_token_s = now
                if r.generated >= r.spec.output_tokens:
                    r.done_s = now
            if r.done_s >= 0:
                ended.append(r)
        for r, take in chunks:
            r.computed += take
            rep.prompt_tokens_left -= take
            if r.computed == r.known:
                r.in_prompt = False
                self._sample(r)
                sampled += 1
                if r.done_s >= 0:
                    ended.append(r)
        for r in ended:
            rep.running.remove(r)
            rep.free_blocks += r.blocks
            r.blocks = 0
            rep.assigned -= 1
        return sampled

    def _release(self, rep: Replica) -> None:
        rep.assigned -= 1
        if rep.draining:
            self._finish_drain(rep)

    def _sample(self, r: SimRequest) -> None:
        now = self.now
        r.generated += 1
        r.known += 1
        if r.generated == 1:
            r.first_token_s = now
        else:
            self.itl.append(now - r.last_token_s)
        r.last_token_s = now
        if r.generated >= r.spec.output_tokens:
            r.done_s = now

    def _transfer(self, r: SimRequest) -> None:
        seconds = 0.0
        if self.transfer is not None:
            seconds = self.transfer.seconds(r.computed * self.kv_bytes_per_token)
        if self.profile.serving is not None:
            seconds += self.profile.serving.handoff_s
        self.transfer_s += seconds
        self._push(self.now + seconds, TRANSFERRED, r)
