"""The routing policy: one cost per candidate replica, in tokens of work; lowest wins.

    prefill cost(r) = work(r) + the prompt tokens ahead on r (queued and running)
                      + backlog * (work(r) - the least uncached prompt tokens on any replica of the pool)
    work(r)         = uncached prompt tokens on r + evict_block_cost * cached blocks the miss would evict on r
    decode cost(r)  = decode_request_cost * requests on r + decode_block_cost * blocks in use on r
                      + (decode_block_cost + pull cost of a block) * prompt blocks r lacks

The decode term counts the decode replica's own cache: it pulls (and allocates) only the blocks it
lacks; a block in its host or disk tier is loaded instead, credited at that tier's weight. A
pulled block costs the pull (measured: the decode pool's median seconds per pulled block,
over the replicas that have pulled, x the prefill pool's prompt tokens a second, unless
pull_block_cost is set; one price for the pool, so a replica that has not pulled yet, or whose
average still carries a pull stalled long ago, is not cheaper or dearer for it) and the block it occupies,
which a cached prefix shares instead. The eviction term is what makes the router capacity-aware:
a replica whose free blocks are all cached prefixes pays for pushing one out, so a new prefix
goes where there is room, and the pool holds more distinct prefixes than one replica can.

Adjustments, each visible in the decision's reason:
- a replica whose recent step time is >= slow_factor x the median of the rest of its pool is
  deprioritised (its cost is multiplied by slow_penalty, plus one token so it loses ties at zero);
- a replica already at hot_load_cap requests gets no credit for its cache, so a hot prefix
  spreads to a second replica instead of piling onto one;
- backlog: the fewest requests waiting on any replica of the pool computing the prompt (failing
  ones left out). While one has none waiting the pool has spare capacity, and a miss's extra work
  (the tokens a holder would not compute, the recompute of what it evicts) costs the request
  alone; once every replica has a queue, that work delays the requests waiting behind it
  (an externality of at least `backlog` requests each token), so the extra is charged
  1 + backlog times and a miss must beat a holder by more the further the whole pool is backed
  up. Without it the policy is bistable on a capacity-bound pool near its capacity: a pool pushed
  past it by misses spreads its prefixes, misses more and never recovers (docs/benchmarks.md, "Why
  seed 5 collapses"). The decision says "pool backlogged".
- local prefill: when the chosen decode replica lacks fewer than local_prefill_threshold prompt
  tokens (or there is no prefill pool), the decode replica prefills them itself.
- colocated (no prefill pool): every decode replica would compute the prompt, so its cost adds the
  prefill cost: uncached prompt tokens on it + the prompt tokens ahead on it (prefix-aware routing).
- session affinity: the replicas that served the request's session last (router/sessions.py) are
  preferred by session_bonus tokens (the others pay it): a soft preference that load outweighs,
  and none past hot_load_cap.
- a draining replica (its role is being flipped: cluster/serving/replica.py set_role) is never
  chosen; a pool whose replicas all drain is a pool with none. A decision names each chosen
  replica's deployment too, whose handle reaches it.
A replica's queue and the wait it predicts are the load model's (router/load_model.py): the
prompt tokens ahead count its running prompts' uncomputed part, and a replica with no rate of its
own (fresh, or just flipped) is priced at its pool's median rate.
Ties are broken at random (an injected RNG). Plain Python: no Ray, no clock of its own.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, fields
from typing import Literal, Sequence

from cluster.engine.kv_cache.hashing import BlockHash
from router import load_model
from router.index import PrefixIndex


DEFAULT_TIER_WEIGHTS = (0.75, 0.25)  # host, disk, before a replica has measured its loads (Dynamo's)


@dataclass(frozen=True)
class ReplicaLoad:
    replica_id: str
    role: Literal["prefill", "decode"]  # the part it plays now (a flip changes it)
    free_blocks: int
    total_blocks: int
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    step_time_s: float = 0.0  # smoothed over recent steps (the slow-replica signal)
    tokens_per_s: float = 0.0  # recent throughput while busy (0: not measured yet)
    failing: bool = False  # its last engine step failed: chosen only when every replica of its pool is
    pull_s_per_block: float = 0.0  # decode: mean seconds per block of its recent KV pulls (0: none yet)
    group: str = ""  # the model version it serves (AppConfig.serving_group): a request is routed within one
    tier_load_s_per_block: tuple[float, ...] = ()  # measured seconds to load one block back, per lower tier (0: none yet)
    # Runtime role flips (cluster/serving/replica.py set_role): `role` is the part a replica plays
    # now, `deployment` the Serve deployment it lives in (whose handle reaches it; None: its
    # role's; a flip never changes it), and a draining replica finishes what it has but is never chosen.
    deployment: Literal["prefill", "decode"] | None = None
    draining: bool = False
    running_prompt_tokens: int = 0  # prompt tokens of running requests not computed yet (chunked prefill)
    rate_samples: int = 0  # samples behind tokens_per_s (0 with a rate: one)
    busy_fraction: float | None = None  # share of recent time in steps (None: not reported)

    def __post_init__(self):
        if self.deployment is None:
            object.__setattr__(self, "deployment", self.role)

    @property
    def requests(self) -> int:
        return self.running + self.waiting

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks


@dataclass(frozen=True)
class PolicyConfig:
    block_size: int = 16
    local_prefill_threshold: int = 64  # tokens: below this, decode prefills the rest itself
    decode_request_cost: float = 32.0  # tokens of work one running request costs a decode replica
    decode_block_cost: float = 1.0
    slow_factor: float = 2.0
    slow_penalty: float = 4.0
    hot_load_cap: int = 32  # requests on a replica past which its cache earns no credit
    # Tokens of work one pulled block costs a decode replica on top of the block it occupies.
    # None: measured (decode's pull_s_per_block x the prefill pool's median tokens_per_s).
    pull_block_cost: float | None = None
    # Tokens: expected recompute of a cached block that a miss pushes out (block_size x the chance
    # it is asked for again). Only blocks beyond the replica's never-cached free ones count.
    evict_block_cost: float = 4.0
    # Credit of a cached block held by a lower tier (host, then disk) against one in the device pool
    # (1.0): it is loaded back instead of computed, but the load costs. None: measured per replica
    # (1 - its seconds per block loaded x its tokens computed a second / block_size), with Dynamo's
    # KV router's 0.75 / 0.25 until it has loaded from that tier.
    tier_weights: tuple[float, ...] | None = None
    session_bonus: float = 256.0  # tokens the replicas that served a session last are preferred by
    max_sessions: int = 100_000  # sessions remembered (least recently used forgotten first)
    session_ttl_s: float = 600.0  # a session idle this long is forgotten

    @classmethod
    def of(cls, options, block_size: int) -> "PolicyConfig":
        """From the app config's routing options (cluster/config/pools.py RoutingOptions), field by
        field by name: what the config declares for the policy is taken, the rest keeps its default
        here (tests/router/test_policy_config.py holds the two declarations together)."""
        taken = {f.name: getattr(options, f.name) for f in fields(cls) if hasattr(options, f.name)}
        if taken.get("tier_weights") is not None:
            taken["tier_weights"] = tuple(taken["tier_weights"])
        return cls(**{**taken, "block_size": block_size})


@dataclass(frozen=True)
class SessionHint:
    """The replicas that served a session's last request (None: none known for that pool; a hint
    adopted from the ingress after a router restart keeps only the replicas still live)."""

    prefill: str | None
    decode: str | None


@dataclass(frozen=True)
class RouteDecision:
    prefill: str | None  # None: local prefill on the decode replica
    decode: str
    mode: Literal["remote", "local"]
    predicted_cached_tokens: int
    reason: str
    queue_wait_s: float = 0.0  # predicted wait before the prompt starts on the replica computing it
    decode_cached_tokens: int = 0  # prompt tokens the decode replica holds already (not pulled)
    # the deployments the chosen replicas live in (whose handles reach them): a replica whose role
    # flipped plays one pool's part from the other's deployment
    prefill_deployment: Literal["prefill", "decode"] | None = None
    decode_deployment: Literal["prefill", "decode"] = "decode"
    queue_ahead: int = 0  # requests waiting on the replica computing the prompt (queue_wait_s is theirs)
    # the prompt's price on the replica computing it, in tokens (its uncached tokens, the tokens
    # ahead of it, the cached blocks it would push out, the backlog's charge on its extra work; no
    # slow penalty or session bonus): what chose the replica within its pool
    compute_cost: float = 0.0
    # compute_cost without the backlog's charge: the prompt's own work and wait there. What two
    # cells compare (Router.price, router/cells.py): a cell charges work beyond the least any of
    # its own replicas needs, so its charge is on no common scale with another cell's (a cell
    # without the prefix charges its misses nothing beyond its own least, which is a miss too)
    prompt_cost: float = 0.0


class NoReplicaError(RuntimeError):
    pass


def split_pools(loads: Sequence[ReplicaLoad]) -> tuple[list[ReplicaLoad], list[ReplicaLoad]]:
    """(prefill, decode) replicas that may be chosen: by the role they play now, draining ones
    left out (a pool of draining replicas only is a pool with none)."""
    prefills, decodes = [], []
    for r in loads:
        if not r.draining:
            (prefills if r.role == "prefill" else decodes).append(r)
    return prefills, decodes


class RoutingPolicy:
    def __init__(self, config: PolicyConfig = PolicyConfig(), rng: random.Random | None = None):
        self.config = config
        self.rng = rng or random.Random()

    def route(
        self,
        hashes: Sequence[BlockHash],
        num_prompt_tokens: int,
        index: PrefixIndex,
        loads: Sequence[ReplicaLoad],
        session: SessionHint | None = None,
    ) -> RouteDecision:
        cfg = self.config
        prefills, decodes = split_pools(loads)
        if not decodes:
            raise NoReplicaError("no decode replica")
        slow = self._slow(decodes) | self._slow(prefills)
        prompt_blocks = -(-num_prompt_tokens // cfg.block_size)
        prefill_rate = statistics.median(r.tokens_per_s for r in prefills if r.tokens_per_s > 0) if any(
            r.tokens_per_s > 0 for r in prefills) else 0.0

        dec_tiers = index.prefix_tiers(hashes, [r.replica_id for r in decodes])
        measured = [r.pull_s_per_block for r in decodes if r.pull_s_per_block > 0]
        pull_s_per_block = statistics.median(measured) if measured else 0.0

        def decode_cost(r: ReplicaLoad) -> float:
            cost = cfg.decode_request_cost * r.requests + cfg.decode_block_cost * r.used_blocks
            if not prefills:  # colocated: the decode replica computes the prompt too
                cost += self._compute_cost(*dec_tiers[r.replica_id], r, num_prompt_tokens, index, dec_charge)
            else:  # it pulls, and allocates, only the blocks it lacks (its tiers' blocks are loaded, at their weight)
                device, lower = dec_tiers[r.replica_id]
                held = device + self._tier_credit(r, lower)
                cost += self._pull_block_cost(pull_s_per_block, prefill_rate) * (prompt_blocks - held)
            return cost

        dec_charge = self._backlog_charge(dec_tiers, decodes, num_prompt_tokens)
        dec_affine = session.decode if session is not None else None
        decode, reasons = self._pick(decodes, decode_cost, slow, dec_affine)
        device, lower = dec_tiers[decode.replica_id]  # its own tiers serve local prefill and imports alike
        cached_on_decode = self._cached_tokens(device + len(lower), decode, num_prompt_tokens)
        missing = num_prompt_tokens - cached_on_decode
        if not prefills or missing < cfg.local_prefill_threshold:
            why = ["no prefill pool" if not prefills else f"local prefill: {missing} uncached tokens"]
            if dec_charge[0]:
                why.append(f"pool backlogged: {dec_charge[0]} waiting on each replica")
            cost = self._compute_cost(device, lower, decode, num_prompt_tokens, index, dec_charge)
            return RouteDecision(None, decode.replica_id, "local", cached_on_decode, "; ".join([*why, *reasons]),
                                 load_model.replica_queue_wait_s(decode, decodes) or 0.0, cached_on_decode,
                                 decode_deployment=decode.deployment, queue_ahead=decode.waiting,
                                 compute_cost=cost, prompt_cost=self._uncharged(cost, dec_charge, device, lower, decode,
                                                                                num_prompt_tokens, index))

        return self._remote(hashes, num_prompt_tokens, index, prefills, slow, session, decode,
                            cached_on_decode, reasons)

    def _remote(self, hashes: Sequence[BlockHash], num_prompt_tokens: int, index: PrefixIndex,
                prefills: Sequence[ReplicaLoad], slow: set[str], session: SessionHint | None, decode: ReplicaLoad,
                cached_on_decode: int, reasons: list[str]) -> RouteDecision:
        """Remote prefill: the prefill replica for a request whose decode replica is chosen."""
        cfg = self.config
        pre_tiers = index.prefix_tiers(hashes, [r.replica_id for r in prefills])
        hot = {r.replica_id for r in prefills if any(pre_tiers[r.replica_id]) and r.requests >= cfg.hot_load_cap}
        credited = {rid: ((0, ()) if rid in hot else held) for rid, held in pre_tiers.items()}
        charge = self._backlog_charge(credited, prefills, num_prompt_tokens)

        def prefill_cost(r: ReplicaLoad) -> float:
            return self._compute_cost(*credited[r.replica_id], r, num_prompt_tokens, index, charge)

        pre_affine = session.prefill if session is not None else None
        prefill, p_reasons = self._pick(prefills, prefill_cost, slow, pre_affine)
        device, lower = pre_tiers[prefill.replica_id]
        cached = self._cached_tokens(device + len(lower), prefill, num_prompt_tokens)
        if prefill.replica_id in hot:
            cached = 0
        why = ["cache" if cached else "load"]
        if hot:
            why.append(f"hot prefix spread past cap on {sorted(hot)}")
        if charge[0]:
            why.append(f"pool backlogged: {charge[0]} waiting on each replica")
        cost = prefill_cost(prefill)
        return RouteDecision(prefill.replica_id, decode.replica_id, "remote", cached,
                             "; ".join([*why, *p_reasons, *reasons]),
                             load_model.replica_queue_wait_s(prefill, prefills) or 0.0, cached_on_decode,
                             prefill.deployment, decode.deployment, queue_ahead=prefill.waiting,
                             compute_cost=cost, prompt_cost=self._uncharged(cost, charge, *credited[prefill.replica_id],
                                                                            prefill, num_prompt_tokens, index))

    def _uncharged(self, cost: float, charge: tuple[int, float], cached_blocks: int, lower: Sequence[int],
                   r: ReplicaLoad, num_prompt_tokens: int, index: PrefixIndex) -> float:
        """`cost` (r's, with the pool's `charge`) without the charge: itself while nothing is
        charged, else priced again uncharged (RouteDecision.prompt_cost)."""
        if not charge[0]:
            return cost
        return self._compute_cost(cached_blocks, lower, r, num_prompt_tokens, index)

    def _backlog_charge(self, tiers: dict[str, tuple[int, Sequence[int]]], pool: Sequence[ReplicaLoad],
                        num_prompt_tokens: int) -> tuple[int, float]:
        """(backlog, least uncached): the fewest requests waiting on any working replica of the pool
        (0 while one has none: spare capacity), and the fewest prompt tokens any replica of it
        would compute for this prompt (its cache credited as `tiers` holds it: device blocks and
        lower tiers' levels). The least is looked for only when there is a backlog to charge."""
        backlog = min((r.waiting for r in pool if not r.failing), default=None)
        if backlog is None:  # every replica failing (or none): they are the pool
            backlog = min((r.waiting for r in pool), default=0)
        if backlog <= 0:
            return 0, 0.0
        least = min(self._uncached_tokens(*tiers[r.replica_id], r, num_prompt_tokens) for r in pool)
        return backlog, least

    def _uncached_tokens(self, cached_blocks: int, lower: Sequence[int], r: ReplicaLoad,
                         num_prompt_tokens: int) -> float:
        """The prompt tokens r would compute: those past its device blocks and its lower tiers'
        (credited at tier_weights)."""
        return num_prompt_tokens - self._cached_tokens(cached_blocks + self._tier_credit(r, lower), r,
                                                       num_prompt_tokens)

    def _compute_cost(self, cached_blocks: int, lower: Sequence[int], r: ReplicaLoad, num_prompt_tokens: int,
                      index: PrefixIndex, charge: tuple[int, float] = (0, 0.0)) -> float:
        """Prompt work on the replica that computes it: its uncached tokens, its queue, and the
        cached blocks its new blocks would push out. Never-cached free blocks are at least
        free - cached (every cached block may be a free one); a miss beyond them evicts. `lower`:
        the levels of the blocks after the device prefix that lower tiers hold (credited at
        tier_weights; they still take device blocks when loaded back). `charge`: the pool's
        (backlog, least uncached tokens) (`_backlog_charge`): the work beyond the least is charged
        backlog times more, for the requests it delays."""
        uncached = self._uncached_tokens(cached_blocks, lower, r, num_prompt_tokens)
        new_blocks = -(-num_prompt_tokens // self.config.block_size) - cached_blocks
        room = max(0, r.free_blocks - index.num_blocks(r.replica_id))
        evicted = min(max(0, new_blocks - room), index.num_blocks(r.replica_id))
        work = uncached + self.config.evict_block_cost * evicted
        backlog, least = charge
        return work + load_model.tokens_ahead(r) + backlog * (work - least)

    def tier_weights(self, r: ReplicaLoad) -> tuple[float, ...]:
        """The credit of a block in each of r's lower tiers: configured, or what computing it
        instead would cost less what loading it back costs (both measured on r), in blocks."""
        if self.config.tier_weights is not None:
            return self.config.tier_weights
        weights = []
        for level, prior in enumerate(DEFAULT_TIER_WEIGHTS):
            load_s = r.tier_load_s_per_block[level] if level < len(r.tier_load_s_per_block) else 0.0
            if load_s > 0 and r.tokens_per_s > 0:
                weights.append(min(1.0, max(0.0, 1.0 - load_s * r.tokens_per_s / self.config.block_size)))
            else:
                weights.append(prior)
        return tuple(weights)

    def _tier_credit(self, r: ReplicaLoad, lower: Sequence[int]) -> float:
        """Blocks' worth of r's lower-tier blocks (their levels: 1 host, 2 disk), at r's weights."""
        if not lower:
            return 0.0
        weights = self.tier_weights(r)
        return sum(weights[level - 1] if level <= len(weights) else 0.0 for level in lower)

    def _pull_block_cost(self, pull_s_per_block: float, prefill_tokens_per_s: float) -> float:
        """Tokens of work one block decode lacks costs it: the block it allocates, plus the pull
        (configured, or measured: the pool's seconds per pulled block at the prefill pool's pace)."""
        pull = self.config.pull_block_cost
        if pull is None:
            pull = pull_s_per_block * prefill_tokens_per_s
        return self.config.decode_block_cost + pull

    def _cached_tokens(self, blocks: float, replica: ReplicaLoad, num_prompt_tokens: int) -> float:
        # An engine always computes at least the last prompt token itself.
        return min(blocks * self.config.block_size, num_prompt_tokens - 1)

    def _slow(self, pool: Sequence[ReplicaLoad]) -> set[str]:
        """Replicas stepping >= slow_factor x the median of the others (leave-one-out: with a
        pool median that includes the replica itself, one slow replica of two is never found)."""
        measured = [r for r in pool if r.step_time_s > 0]
        n = len(measured)
        if n < 2:
            return set()
        # Sorted once: without the replica at sorted position i, the others' rank k is s[k] below
        # i and s[k + 1] from it. O(n log n) a decision; a median per replica was O(n^2 log n),
        # 53% of a decision at 128 replicas (docs/benchmarks.md, "Where the router and the ingress
        # saturate"). The arithmetic is statistics.median's, so the answer is the same.
        s = sorted(r.step_time_s for r in measured)
        order = sorted(range(n), key=lambda j: measured[j].step_time_s)
        m = n - 1  # the others
        lo, hi = (m - 1) // 2, m // 2
        slow = set()
        for i, j in enumerate(order):
            a = s[lo] if lo < i else s[lo + 1]
            b = s[hi] if hi < i else s[hi + 1]
            others = a if lo == hi else (a + b) / 2
            r = measured[j]
            if r.step_time_s >= self.config.slow_factor * others:
                slow.add(r.replica_id)
        return slow

    def _pick(self, pool: Sequence[ReplicaLoad], cost, slow: set[str],
              affine: str | None = None) -> tuple[ReplicaLoad, list[str]]:
        """The cheapest replica. `affine`: the one that served the session last; the others pay
        session_bonus, unless it is failing or at hot_load_cap (then the bonus is void)."""
        working = [r for r in pool if not r.failing]
        failing = sorted(r.replica_id for r in pool if r.failing)
        if working and failing:  # an idle replica whose steps fail would otherwise look cheapest
            choice, reasons = self._pick(working, cost, slow, affine)
            return choice, [*reasons, f"failing replica avoided: {', '.join(failing)}"]
        raw = {r.replica_id: cost(r) for r in pool}
        sticky = next((r for r in pool if r.replica_id == affine and r.requests < self.config.hot_load_cap), None)
        if sticky is not None and len(pool) > 1:
            raw = {rid: c if rid == affine else c + self.config.session_bonus for rid, c in raw.items()}
        costs = {rid: c * self.config.slow_penalty + 1.0 if rid in slow else c for rid, c in raw.items()}
        choice = self._argmin(costs)
        unpenalised = min(raw, key=lambda rid: (raw[rid], rid))
        reasons = []
        if unpenalised in slow and raw[unpenalised] < raw[choice]:
            reasons.append(f"slow replica avoided: {unpenalised}")
        if affine is not None and len(pool) > 1:
            reasons.append(f"session kept on {affine}" if choice == affine else f"session moved off {affine}")
        return next(r for r in pool if r.replica_id == choice), reasons

    def _argmin(self, costs: dict[str, float]) -> str:
        best = min(costs.values())
        tied = sorted(rid for rid, c in costs.items() if c == best)
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)
