"""A request's legs on the pools: remote prefill (the first token and a handle of the prompt's
KV, held under a lease) and the decode legs (the rest of the tokens; a new leg on another replica
when one dies). Every failure ends in a ServingError with its code; nothing here decides policy.
A replica's traceback, pid and paths go to the log, never into a client's message (`told`).

A replica is reached through its home deployment's handle (`homes`), whatever role it plays now
(a router decision names both); without a decision, each leg calls its pool's deployment. A
replica called for a role it no longer plays refuses before starting (WrongRoleError): a prefill
leg then leaves the prompt to decode, a decode leg goes to the replica a new decision names."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable, Mapping

from cluster.engine.outputs import FAILED, FinishReason, RequestOutput, merge_outputs
from cluster.engine.request import RequestContext
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import ErrorKind, QueueFullError, WrongRoleError
from router.ingress.flow.relay import coalesce
from router.ingress.flow.stream import ClientStream
from router.ingress.request import Delta
from router.ingress.status import Code, Rejected, ServingError
from router.replies import RepliesLost, ReplyInbox

log = logging.getLogger(__name__)

OVERLOAD_RETRY_S = 1.0  # retry-after for an engine's refusal (full queue, queue time-to-live)
FIRST_OUTPUT_GRACE_S = 1.0  # past the deadline: a replica that has the request ends it itself, first
MAX_REROUTES = 2  # decode legs refused by a replica whose role flipped, before the request fails
LATE_ANSWER_WAIT_S = 30.0  # an abandoned prefill call is awaited this long (at least) for a lease to release
CLIENT_SAFE = (QueueFullError, WrongRoleError)  # errors whose message a client may read (see `told`)

# A call and its outputs go over the gRPC channel Serve keeps to every replica, not as Ray tasks
# and objects (an object, two wake-ups and the core worker's bookkeeping per streamed message: most
# of the front door's CPU a message; docs/benchmarks.md, "The front door's parts"). That channel caps
# a message at 4 MiB (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH): a request whose prompt or outputs
# may come near it (logprobs, a prompt past this many tokens) goes by reference, as before.
VIA_GRPC_MAX_TOKENS = 262_144


def by_reference(ids: list[int], sampling: SamplingParams) -> bool:
    """Whether a request's calls go by reference (Ray tasks and objects) rather than over gRPC."""
    logprobs = sampling is not None and (sampling.logprobs is not None or sampling.prompt_logprobs is not None)
    return logprobs or len(ids) > VIA_GRPC_MAX_TOKENS


class Homes:
    """Every deployment's handle, by home, and the variants a call goes by (the pools stay Serve
    deployments either way: Serve picks the replica, or takes the router's target_replica, and
    counts the replica's load). A variant is made once: `options()`, and a handle's method
    attribute, copy its options on every use; variants share their handle's request router."""

    def __init__(self, homes: Mapping[str, object], default):
        self.homes = dict(homes)
        self.default = default  # a home not in `homes` (None: no decision named one)
        self._variants: dict[tuple[str | None, str, bool, bool], object] = {}

    def get(self, home: str | None):
        return self.homes.get(home, self.default)

    def via(self, home: str | None, method: str, ids: list[int], sampling: SamplingParams, stream: bool = False):
        """`home`'s handle for `method`, by reference or over gRPC as the request needs."""
        key = (home if home in self.homes else None, method, by_reference(ids, sampling), stream)
        handle = self._variants.get(key)
        if handle is None:
            handle = self.get(home)
            if not key[2]:  # the call's arguments are our own plain dataclasses: C pickle, not cloudpickle (~3x)
                try:
                    handle = handle.options(_by_reference=False, request_serialization="pickle")
                except TypeError:  # a Ray before Serve's request_serialization
                    handle = handle.options(_by_reference=False)
            if stream:
                handle = handle.options(stream=True)
            handle = self._variants[key] = getattr(handle, method)  # Serve's: options(method_name=method)
        return handle


# A decode replica a fresh routing decision names: (replica id, home deployment), or (None, None): Serve's choice
Reroute = Callable[[], Awaitable[tuple[str | None, str | None]]]


class ReplicaDied(Exception):
    """The decode replica serving a leg was lost (the request may migrate)."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


def told(e: BaseException) -> str:
    """What a client is told of an exception a replica raised (or Ray raised on its way): the
    message of our own errors, written for clients (replica ids, bounds), else the class alone.
    Ray's text of a remote failure is the replica's traceback, with its pid, host and source
    paths: that goes to the ingress's log only. A RayTaskError carries the replica's own
    exception as `cause` (ReplicaDied carries Ray's)."""
    for _ in range(4):  # a cause of a cause: bounded, Ray nests them at most this deep
        cause = getattr(e, "cause", None)
        if not isinstance(cause, BaseException):
            break
        e = cause
    return str(e) if isinstance(e, CLIENT_SAFE) else type(e).__name__


class ForwardFailed(ServingError):
    """Poison containment: the forward of a step holding the request raised on a replica (`pool`).
    The request may be what broke it, so it ends here, INTERNAL (not retryable: the same request
    would fail again), and is neither retried on decode nor migrated: a poison request used to
    fail or end (tensor parallelism) 1 + max_migrations replicas. Counted by the ingress's
    telemetry (pdserve_requests_contained, by pool)."""

    def __init__(self, rid: str, pool: str, replica: str | None, error: str | None, sent: int):
        on = "" if replica is None else f" {replica}"
        super().__init__(Code.INTERNAL, f"request {rid}: the forward holding it failed on {pool} replica{on} after "
                                        f"{sent} tokens ({error}); not retried on another replica, as it may be "
                                        "what made the forward fail")
        self.contained_pool = pool


def ended(rid: str, reason: FinishReason, error: str | None, sent: int, kind: ErrorKind | None = None,
          replica: str | None = None) -> ServingError:
    """The error for a request an engine (of the decode pool, on `replica`) ended without finishing it."""
    if kind == ErrorKind.FORWARD:
        return ForwardFailed(rid, "decode", replica, error, sent)
    if kind == ErrorKind.INVALID_INPUT:  # its own numbers failed it (e.g. sampling overflow): a 400
        return ServingError(Code.INVALID_ARGUMENT, f"request {rid}: {error}")
    if reason == FinishReason.DEADLINE:
        return ServingError(Code.DEADLINE_EXCEEDED, f"request {rid}: {error or 'deadline exceeded'}")
    if reason == FinishReason.REJECTED:
        return Rejected(f"request {rid}: {error or 'overloaded'}", OVERLOAD_RETRY_S)
    return ServingError(Code.ABORTED if sent else Code.INTERNAL, f"request {rid} failed after {sent} tokens: {error}")


class PrefillLeg:
    """Remote prefill on the prefill pool (its Serve handle; `homes`: every deployment's, by home)."""

    def __init__(self, handle, replica_wait_s: float = 120.0, homes: Mapping[str, object] | None = None):
        self.handle = handle
        self.homes = Homes({**(homes or {}), "prefill": handle}, handle)
        self.replica_wait_s = replica_wait_s  # the bound on a prefill's answer, deadline or not
        # lease holders that live outside the prefill deployment (a flipped decode replica): where
        # a release goes. Replica ids are never reused, and their homes never change.
        self._holders_away: dict[str, str] = {}
        self.late_calls: set[asyncio.Task] = set()  # abandoned calls awaited for a late lease (`_abandon`)

    async def first_token(self, rid: str, ids: list[int], sampling: SamplingParams, ctx: RequestContext,
                          target: str | None, stream: ClientStream, home: str | None = None):
        """The first token's delta (sent at once, before any transfer) and the handle of the
        prompt's KV for decode to pull (None when the first token ends the request). None when
        prefill failed: decode prefills locally. `home`: the deployment `target` lives in."""
        result = await self._prefill(rid, ids, sampling, ctx, target, home)
        if result is None:
            return None
        if result.handle is not None and home not in (None, "prefill"):
            self._holders_away[result.handle.engine_id] = home
        stream.cached = result.num_cached_tokens
        first_lp = None if result.first_logprob is None else [result.first_logprob]
        if result.handle is None:  # the first token ends it
            return stream.delta([result.first_token], result.finish_reason, first_lp, result.prompt_logprobs), None
        d = stream.delta([result.handle.first_token], None, first_lp, result.prompt_logprobs)
        if d.finish_reason is not None:  # a stop string in the first token's text
            await self.release(rid, result.handle.engine_id)
        return d, result.handle

    async def _prefill(self, rid: str, ids: list[int], sampling: SamplingParams, ctx: RequestContext,
                       target: str | None, home: str | None):
        # A replica that has the request ends it at its deadline itself (DEADLINE, the client's);
        # none answering by then (+ grace), or within replica_wait_s without a deadline, is the
        # pool's failure (no replica took it: dead, asleep, stuck), as for decode. The call is
        # then abandoned (`_abandon`): its prefill aborted where the replica is known, and a lease
        # in a late answer released.
        call = asyncio.ensure_future(self.homes.via(home, "prefill", ids, sampling).remote(
            rid, ids, sampling, ctx, target_replica=target))
        remaining = ctx.remaining_s()
        bound = self.replica_wait_s
        deadline_first = remaining is not None and max(remaining, 0.0) + FIRST_OUTPUT_GRACE_S < bound
        if deadline_first:
            bound = max(remaining, 0.0) + FIRST_OUTPUT_GRACE_S
        try:
            result = await asyncio.wait_for(asyncio.shield(call), bound)
        except asyncio.CancelledError:  # the request went away mid-call
            self._abandon(rid, call, target, home)
            raise
        except (TimeoutError, asyncio.TimeoutError) as e:
            self._abandon(rid, call, target, home)
            if deadline_first:
                raise ServingError(Code.DEADLINE_EXCEEDED, f"request {rid}: deadline exceeded before a prefill replica "
                                                           "answered", replica_fault=True) from e
            raise ServingError(Code.UNAVAILABLE, f"request {rid}: no prefill replica answered within "
                                                 f"{self.replica_wait_s:g} s (fault_tolerance.replica_wait_s)") from e
        except QueueFullError as e:
            raise Rejected(f"request {rid}: {told(e)}", OVERLOAD_RETRY_S) from e
        except WrongRoleError as e:  # it flipped to decode after the decision: nothing started there
            log.info("prefill of %s refused (%s); prefilling on decode", rid, e)
            return None
        except Exception as e:  # noqa: BLE001 — any other prefill failure: decode prefills locally
            log.warning("prefill of %s failed (%s); prefilling on decode", rid, e)
            return None
        if result.finish_reason in (FinishReason.DEADLINE, FinishReason.REJECTED):
            raise ended(rid, result.finish_reason, result.error, 0)
        if result.finish_reason == FinishReason.ERROR and result.error_kind == ErrorKind.FORWARD:
            log.error("prefill of %s: its forward failed on %s (%s); ending it, not prefilling on decode", rid,
                      target or "a prefill replica", result.error)
            raise ForwardFailed(rid, "prefill", target, result.error, 0)
        if result.finish_reason == FinishReason.ERROR:
            log.warning("prefill of %s failed (%s); prefilling on decode", rid, result.error)
            return None
        return result

    def _abandon(self, rid: str, call: asyncio.Future, target: str | None, home: str | None) -> None:
        """The ingress gave up on a prefill call (it timed out, or its request went away), which
        may still answer with a lease: released on its replica as soon as it lands, not left to
        lease_s. A named replica is told at once (`release` aborts a prefill still running there,
        or ends the lease it already holds); either way the call is awaited, up to
        max(replica_wait_s, LATE_ANSWER_WAIT_S) more (then cancelled), and a lease in its answer
        released. `late_calls` holds these waits."""
        if target is not None and home not in (None, "prefill"):
            self._holders_away[target] = home

        async def settle():
            if target is not None:
                await self.release(rid, target)
            try:
                result = await asyncio.wait_for(call, max(self.replica_wait_s, LATE_ANSWER_WAIT_S))
            except BaseException:  # noqa: BLE001 — no answer, or no lease in it
                return
            handle = getattr(result, "handle", None)
            if handle is not None:
                log.info("prefill of %s answered after the ingress gave up; releasing its lease on %s", rid,
                         handle.engine_id)
                if home not in (None, "prefill"):
                    self._holders_away[handle.engine_id] = home
                await self.release(rid, handle.engine_id)

        task = asyncio.get_running_loop().create_task(settle())
        self.late_calls.add(task)
        task.add_done_callback(self.late_calls.discard)

    async def release(self, rid: str, holder: str) -> None:
        """End a lease early, on the prefill replica that holds it (the handle's engine id is its
        Serve replica id; the request router honours target_replica). If that replica is gone
        the router picks another, which holds nothing of `rid` (ids are ours and unique): a no-op."""
        try:
            home = self.homes.get(self._holders_away.get(holder))
            await home.release.remote(rid, target_replica=holder)
        except Exception as e:  # noqa: BLE001 — the lease expires anyway
            log.warning("release of %s on %s failed (its lease will expire): %s", rid, holder, e)


class DecodeLegs:
    """The decode leg, and its migrations. If its replica dies, another decode replica gets the
    prompt and every token sent so far, as the request's output (prefilled there: max_tokens,
    min_tokens and the penalties count them as before), and produces the rest, so the client's
    stream goes on without a gap or a repeat (greedy output is identical; a seeded sampler
    restarts its random stream at the migration)."""

    def __init__(self, handle, max_migrations: int, prefill: PrefillLeg | None, replica_wait_s: float = 120.0,
                 homes: Mapping[str, object] | None = None, replies: ReplyInbox | None = None):
        self.handle = handle
        self.replies = replies  # where replicas write a leg's outputs (router/replies.py); None: Serve's stream
        self.homes = Homes({**(homes or {}), "decode": handle}, handle)
        self.max_migrations = max_migrations
        self.prefill = prefill  # where a handle's lease is released when decode never took it
        self.replica_wait_s = replica_wait_s  # the bound on waiting for a replica, deadline or not

    async def stream(self, rid: str, ids: list[int], sampling: SamplingParams, ctx: RequestContext, kv_handle,
                     target: str | None, client: ClientStream, home: str | None = None,
                     reroute: Reroute | None = None) -> AsyncIterator[Delta]:
        """`target` lives in deployment `home`; `reroute` names another decode replica when that
        one turns out not to decode (without it: Serve's choice in the decode deployment)."""
        generated = client.generated
        leg_rid, leg_generated = rid, []
        for migration in range(self.max_migrations + 1):
            if migration:
                leg_rid, leg_generated = f"{rid}.m{migration}", list(generated)
                log.warning("decode replica of %s died after %d tokens; migrating (%d of %d)",
                            rid, len(generated), migration, self.max_migrations)
            try:
                async with aclosing(self._placed(leg_rid, ids, sampling, kv_handle, ctx, target, home, reroute,
                                                 client, leg_generated)) as leg:
                    async for d in leg:
                        if kv_handle is None and migration == 0:
                            client.cached = d.cached_prompt_tokens
                        d.cached_prompt_tokens = client.cached  # a migrated leg's count covers tokens already sent
                        yield d
                        if d.finish_reason is not None:
                            return
            except ReplicaDied as e:
                kv_handle, target, home = None, None, None  # the next leg prefills on its own replica
                if migration < self.max_migrations:
                    continue
                raise self._gave_up(rid, len(generated), e) from e
            raise ServingError(Code.INTERNAL, f"decode stream for {rid} ended without a finish")

    async def _placed(self, rid: str, ids: list[int], sampling: SamplingParams, kv_handle, ctx: RequestContext,
                      target: str | None, home: str | None, reroute: Reroute | None, client: ClientStream,
                      generated: list[int]) -> AsyncIterator[Delta]:
        """One leg, on the replica a decision named. One that no longer decodes (its role flipped
        after the decision) refuses before anything starts: the leg goes to the replica `reroute`
        names, with the same KV handle (still leased). Not a migration: nothing was sent."""
        for attempt in range(MAX_REROUTES + 1):
            try:
                async with aclosing(self._leg(rid, ids, sampling, kv_handle, ctx, target, home, client,
                                              generated)) as leg:
                    async for d in leg:
                        yield d
                return
            except WrongRoleError as e:
                if attempt == MAX_REROUTES:
                    if kv_handle is not None and self.prefill is not None:
                        await self.prefill.release(rid, kv_handle.engine_id)
                    raise ServingError(Code.UNAVAILABLE, f"decode for {rid}: {attempt + 1} replicas refused it "
                                                         f"(their roles flipped): {told(e)}") from e
                log.info("decode of %s refused (%s); routing it again", rid, e)
                target, home = await reroute() if reroute is not None else (None, None)

    def _gave_up(self, rid: str, sent: int, e: ReplicaDied) -> ServingError:
        log.warning("decode of %s gave up after %d tokens: %s", rid, sent, e.cause)
        if not sent:  # the last try never started
            return ServingError(Code.UNAVAILABLE, f"decode failed for {rid}: {told(e)}")
        return ServingError(Code.ABORTED, f"decode replica of {rid} died after {sent} tokens were sent "
                                          f"({self.max_migrations} migrations allowed): {told(e)}")

    async def _leg(self, rid: str, ids: list[int], sampling: SamplingParams, kv_handle, ctx: RequestContext,
                   target: str | None, home: str | None, client: ClientStream,
                   generated: list[int]) -> AsyncIterator[Delta]:
        """One decode leg: the replica's outputs as deltas. Raises ReplicaDied when the replica is
        lost (the caller migrates), WrongRoleError when it does not decode now (the lease is
        kept for the next replica), ServingError for the request's own failures. `generated`:
        tokens sent by earlier legs (the replica's output counts include them)."""
        from ray.exceptions import ActorUnavailableError, RayActorError  # noqa: PLC0415

        try:
            replies, box = self._call(rid, ids, sampling, kv_handle, ctx, target, home, generated)
        except Exception as e:  # noqa: BLE001
            if kv_handle is not None and self.prefill is not None:  # nothing will pull it: end the lease now
                await self.prefill.release(rid, kv_handle.engine_id)
            log.warning("decode of %s could not be sent: %s", rid, e)
            raise ServingError(Code.UNAVAILABLE, f"no decode replica: {told(e)}") from e
        state = _LegState()
        try:
            async with aclosing(self._outputs(rid, replies, kv_handle, ctx, client, state, target, box)) as outputs:
                async for d in outputs:
                    yield d
        except ServingError:
            raise
        except WrongRoleError:
            state.refused = True
            raise
        except TimeoutError as e:
            if state.bound is None or not state.bound.expired():
                log.warning("decode of %s on replica %s timed out: %s", rid, target, e)
                raise ServingError(Code.ABORTED if state.pulled else Code.UNAVAILABLE,
                                   f"decode failed for {rid}{_on(target)}: {told(e)}") from e
            if state.deadline_first:  # the client's deadline, spent on the version's replicas: their fault too
                raise ServingError(Code.DEADLINE_EXCEEDED, f"request {rid}: deadline exceeded before a decode "
                                                           "replica took it", replica_fault=True) from e
            raise ServingError(Code.UNAVAILABLE, f"request {rid}: no decode replica took it within "
                                                 f"{self.replica_wait_s:g} s (fault_tolerance.replica_wait_s)") from e
        except QueueFullError as e:  # the decode replica's queue is full (raised by its submit)
            raise Rejected(f"request {rid}: {told(e)}", OVERLOAD_RETRY_S) from e
        except (RayActorError, ActorUnavailableError, RepliesLost) as e:
            state.died = True
            raise ReplicaDied(e) from e
        except Exception as e:
            log.warning("decode of %s on replica %s failed: %s", rid, target, e)  # the replica's traceback
            raise ServingError(Code.ABORTED if state.pulled else Code.UNAVAILABLE,
                               f"decode failed for {rid}{_on(target)}: {told(e)}") from e
        finally:
            if box is not None:
                box.close(state.finished)
            if not state.finished:
                replies.cancel()
            # Only the first leg has a handle. Its lease ends here where nothing else ends it: the
            # replica never took the request (no READ), or died (its "done" notice for a READ it
            # completed may have died with it: notices are best effort). Else lease_s ends it.
            if kv_handle is not None and (state.died or not state.pulled) and not state.refused \
                    and self.prefill is not None:
                await self.prefill.release(rid, kv_handle.engine_id)

    def _call(self, rid: str, ids: list[int], sampling: SamplingParams, kv_handle, ctx: RequestContext,
              target: str | None, home: str | None, generated: list[int]):
        """The leg's Serve call, and the mailbox its outputs come to as frames (router/replies.py;
        None: they stream on the call)."""
        box = None if self.replies is None or by_reference(ids, sampling) else self.replies.open(rid)
        try:
            return self.homes.via(home, "generate", ids, sampling, stream=True).remote(
                rid, ids, sampling, kv_handle, ctx, target_replica=target, generated=generated,
                **({} if box is None else {"reply_to": box.reply_to})), box
        except BaseException:
            if box is not None:
                box.close()
            raise

    async def _outputs(self, rid: str, replies, kv_handle, ctx: RequestContext, client: ClientStream,
                       state: "_LegState", target: str | None = None, box=None) -> AsyncIterator[Delta]:
        # Until a replica takes the request, nothing enforces its deadline (a sleeping pool is
        # loading one, every replica's queue full at Serve's router): bound that wait here, by the
        # deadline or replica_wait_s, whichever comes first. From its first output the engine has
        # it, and ends it at the deadline itself.
        now, remaining = asyncio.get_running_loop().time(), ctx.remaining_s()
        first_by = now + self.replica_wait_s
        if remaining is not None and now + max(remaining, 0.0) + FIRST_OUTPUT_GRACE_S < first_by:
            first_by, state.deadline_first = now + max(remaining, 0.0) + FIRST_OUTPUT_GRACE_S, True
        source = coalesce(replies, merge_outputs, final=lambda o: o.finished,
                          alone=lambda o: o.finish_reason in FAILED) if box is None else box.outputs(replies)
        async with asyncio.timeout_at(first_by) as state.bound, aclosing(source) as outs:
            async for out in outs:
                out: RequestOutput
                if not state.pulled:
                    state.bound.reschedule(None)
                state.pulled = True
                if out.finish_reason in FAILED:
                    raise ended(rid, out.finish_reason, out.error, out.num_output_tokens, out.error_kind, target)
                d = client.delta(out.token_ids, out.finish_reason if out.finished else None, out.logprobs,
                                 out.prompt_logprobs)
                if kv_handle is None:  # the prompt was computed on this replica: what its cache saved
                    d.cached_prompt_tokens = out.num_cached_tokens
                state.finished = d.finish_reason is not None
                if d.text or d.token_ids or d.finish_reason:
                    yield d
                if state.finished:
                    return


def _on(target: str | None) -> str:
    return "" if target is None else f" on replica {target}"


class _LegState:
    """What one leg's cleanup needs to know of how far it got."""

    __slots__ = ("bound", "deadline_first", "pulled", "finished", "refused", "died")

    def __init__(self):
        self.bound = None  # the bound on the first output (asyncio.Timeout)
        self.deadline_first = False  # the request's deadline, not replica_wait_s, sets that bound
        self.pulled = False  # the replica sent an output: it has the request (and pulled the KV)
        self.finished = False
        self.refused = False  # the replica does not decode now: nothing started there
        self.died = False  # the replica was lost mid-leg (the request may migrate)
