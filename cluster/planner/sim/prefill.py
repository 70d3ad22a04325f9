"""A prefill replica's step: prompts part-way first, then its queue in order, up to chunk_tokens,
priced by the profile's prefill curve; a prompt whose last chunk ends samples its first token and
is handed to its decode replica (the transfer, decode.py)."""

from __future__ import annotations

from cluster.planner.sim.state import Replica


class PrefillSteps:
    def _schedule_prefill(self, rep: Replica):
        budget = self.config.chunk_tokens
        work = []
        for r in rep.running:
            if budget == 0:
                break
            take = min(r.known - r.computed, budget)
            work.append((r, take))
            budget -= take
        while budget > 0 and rep.waiting:
            r = rep.waiting.popleft()
            rep.running.append(r)
            take = min(r.known - r.computed, budget)
            work.append((r, take))
            budget -= take
        if not work:
            return None
        return self._prefill_seconds(work), work

    def _prefill_seconds(self, work) -> float:
        return self.profile.prefill(*chunk_shape(work))

    def _prefill_done(self, rep: Replica, work) -> int:
        """The step's chunks are computed; returns the tokens sampled (first tokens)."""
        sampled = 0
        for r, take in work:
            r.computed += take
            rep.prompt_tokens_left -= take
            if r.computed == r.known:
                r.in_prompt = False
                rep.running.remove(r)
                self._sample(r)
                sampled += 1
                if r.done_s < 0:
                    self._transfer(r)
                else:  # its first token ended it: decode never takes it
                    self._release(r.decode)
        return sampled


def chunk_shape(work) -> tuple[int, float]:
    """A step's prompt chunks ((request, tokens taken), ...): their tokens, and the token-weighted
    context computed before them."""
    tokens = sum(take for _, take in work)
    return tokens, sum(r.computed * take for r, take in work) / tokens
