"""The decode pool's pace as this ingress relays it, and the limit on streams it implies
(`StreamPace`, read by `Capacity` in capacity.py)."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

from router.ingress.gateway.queue_model import MIN_SAMPLE_S, Meter

SLOW_WINDOWS = 2  # windows in a row over target_itl_s before the pace limit shrinks
PROBE_AT = 0.8  # the pace limit grows while the streams reach this share of it within the target...
PROBE_STEP = 0.25  # ... by this share of itself a window
MIN_LIMIT = 2.0  # a running stream and one more user are never refused for the pace
PROVEN_S = 30.0  # the most streams a window ran within the target is a floor of the limit this long
CALM_WINDOWS = 4  # windows in a row within the target and under PROBE_AT of the limit before it is lifted
MIN_STREAM_TOKENS = 4  # tokens past its first before a stream's own pace counts
WEIGHT_TOKENS = 16  # a stream's pace weighs its tokens so far, up to this many
FLOOR_HOLD_S = 60.0  # the fastest pace seen holds this long...
FLOOR_TAU_S = 300.0  # ...then fades towards later windows' with this time constant


class Stream:
    """One stream past its first token: when that came, its last token, and the tokens since."""

    __slots__ = ("first_at", "last_at", "tokens")

    def __init__(self, now: float):
        self.first_at = self.last_at = now
        self.tokens = 0

    def tpot_s(self) -> float | None:
        """Its own time per output token so far, as its client measures it (None: too few yet)."""
        return (self.last_at - self.first_at) / self.tokens if self.tokens >= MIN_STREAM_TOKENS else None


def weighted_pace(streams: list[Stream]) -> float:
    """The streams' own paces so far, each weighing its tokens up to WEIGHT_TOKENS."""
    weights = [min(s.tokens, WEIGHT_TOKENS) for s in streams]
    return sum(w * s.tpot_s() for w, s in zip(weights, streams)) / sum(weights)


class StreamPace(Meter):
    """The streams past their first token and their pace as this ingress relays them (the decode
    pool's, measured where the client gets it), over windows of MIN_SAMPLE_S with at least one
    stream running, and the limit on streams it implies.

    A window's pace is its streams' own time per output token so far (each since its first
    token; the streams that ended in the window at their final one), each weighing its tokens up
    to WEIGHT_TOKENS (`weighted_pace`), not the window's mean interval: on a colocated replica
    every prefill chunk stalls every stream for a chunk's time (~270 ms on this CPU), so a 0.5 s
    window's mean interval read 250-470 ms while the requests' own TPOT was p50 61 ms, and the pace
    cap refused 10 of the 90 requests of a plan's own trace that the plan said would meet its SLO.
    Nor is it their median: a clump of arrivals' prompt chunks stall every stream, and the young
    streams, then the majority, read the stalls over their first few tokens (a near-saturation
    trace was refused 1-3 of 60 at "388 ms per token over 10.0 streams" while the served requests'
    TPOT was p90 161-243 ms, target 320). The weight is capped so that a pool that really slows
    is not hidden for long behind its oldest streams' history. A window whose streams have too
    few tokens yet falls back on its mean interval (stream-seconds over tokens).

    The limit (`cap()`) exists once SLOW_WINDOWS windows in a row measured the pace over the
    target: it is then set to the streams the pool would run at the target by the gradient of the
    last one (mean streams x target / measured pace); at or over it, new work is refused, so
    running streams keep their pace instead of every stream slowing together. While the pace stays
    within the target and the streams reach PROBE_AT of the limit, it grows by PROBE_STEP a window
    (or to the gradient, if larger). No cap before the pool was first measured slow: at low load a
    step's fixed cost dominates the interval, and the gradient through zero would refuse a pool
    that is far from full. For the same reason the limit is lifted after CALM_WINDOWS windows in a
    row within the target and under PROBE_AT of it: the load that set it has passed, and a limit
    the streams no longer reach would only refuse the next clump of arrivals (streams and the
    requests ahead of their first token count against it) while the pace is well inside the target.
    Under a load that presses on it, windows reach PROBE_AT and the limit probes instead.

    The limit is never set under the most streams a window ran within the target in the last
    PROVEN_S (nor under MIN_LIMIT): a pace that is slow at fewer streams than the pool just ran
    well is not the streams' doing (on a colocated replica, prompt chunks stall every stream, and
    a young stream's own pace reads its first stall), and refusing streams would not bring it
    back; at or over that many, new work still waits for the pace to return. For the same reason
    a window of about one stream (mean under 1.5) sets nothing however slow: a single stream's
    pace is the prompts' beside it (the queue bound's to govern), not the streams'. Without it, a plan's
    own trace was refused 4 of 60 at "measured 260 ms per token over 2.5 streams" against a target
    of 320 ms, where the pool had run 4-5 streams within it moments before.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, alpha: float = 0.3,
                 target_itl_s: float | None = None, floor_multiple: float = 0.0,
                 steady: Callable[[], bool] = lambda: True):
        super().__init__(clock, alpha)
        self.steady = steady  # the load is not growing: the floor multiple may loosen the target
        self.target_itl_s = target_itl_s
        self.streams = 0
        self.itl_s: float | None = None  # None until measured
        self.mean_streams = 0.0  # over the last window
        self.limit: float | None = None  # streams; None until SLOW_WINDOWS windows in a row were over the target
        self.floor_multiple = floor_multiple
        # the fastest window's pace, fading towards later windows' (FLOOR_TAU_S): this deployment's own
        self.floor_itl_s: float | None = None
        self._floor_set_at = self._floor_at = self._last  # when a window set it; when it last moved
        self._slow_windows = 0
        self._calm_windows = 0
        self._proven: deque[tuple[float, int]] = deque()  # (when, streams) of windows within the target, streams falling
        self._window_s = 0.0
        self._stream_s = 0.0  # integral of streams over the window
        self._tokens = 0
        self._live: set[Stream] = set()
        self._ended: list[Stream] = []  # the streams that ended in this window (with their own pace)

    def start(self) -> Stream:
        self._advance()
        self.streams += 1
        stream = Stream(self._last)
        self._live.add(stream)
        return stream

    def end(self, stream: Stream | None = None) -> None:
        self._advance()
        self.streams -= 1
        if stream is not None and stream in self._live:
            self._live.discard(stream)
            if stream.tpot_s() is not None:
                self._ended.append(stream)

    def tokens(self, n: int, stream: Stream | None = None) -> None:
        self._advance()
        self._tokens += n
        if stream is not None:
            stream.tokens += n
            stream.last_at = self._last
        if self._window_s >= MIN_SAMPLE_S and self._tokens > 0:
            measured = [s for s in self._live if s.tpot_s() is not None]
            paced = measured + self._ended
            sample = weighted_pace(paced) if paced else self._stream_s / self._tokens
            self.itl_s = self._smooth(self.itl_s, sample)
            self.mean_streams = self._stream_s / self._window_s
            self._window_s = self._stream_s = 0.0
            self._tokens = 0
            self._ended = []
            self._adjust(sample, len(measured) if paced else int(self.mean_streams))

    def target(self) -> float | None:
        """The interval streams are held to: target_itl_s, or with a floor multiple the larger of it and
        that multiple of the fastest pace measured while the load is steady (a CPU whose one
        stream is slower than the objective still runs as many streams as keep its own pace; a
        growing load is held to the objective, so a burst cannot crowd the streams it shares cores with)."""
        if self.target_itl_s is None or not self.floor_multiple or self.floor_itl_s is None or not self.steady():
            return self.target_itl_s
        return max(self.target_itl_s, self.floor_multiple * self.floor_itl_s)

    def _floor(self, itl_s: float) -> None:
        """A decayed minimum: a window at least as fast sets it; once it is FLOOR_HOLD_S old, a
        slower window pulls it towards its pace by 1 - e^(-dt/FLOOR_TAU_S) of the gap (dt: the
        time past the hold since the last window), so one fast glitch (tokens relayed in a clump,
        a pool since grown busier for good) does not hold it for ever."""
        now = self._last
        if self.floor_itl_s is None or itl_s <= self.floor_itl_s:
            self.floor_itl_s, self._floor_set_at, self._floor_at = itl_s, now, now
            return
        held = self._floor_set_at + FLOOR_HOLD_S
        dt = max(0.0, now - max(held, self._floor_at))
        self.floor_itl_s += (itl_s - self.floor_itl_s) * (1 - math.exp(-dt / FLOOR_TAU_S))
        self._floor_at = now

    def proven(self, ran: int | None = None) -> int:
        """The most streams a window ran within the target in the last PROVEN_S (0: none);
        `ran`: the streams of a window just measured within the target, recorded first."""
        now, proven = self._last, self._proven
        while proven and proven[0][0] < now - PROVEN_S:
            proven.popleft()
        if ran is not None:
            while proven and proven[-1][1] <= ran:
                proven.pop()
            proven.append((now, ran))
        return proven[0][1] if proven else 0

    def _adjust(self, itl_s: float, ran: int) -> None:
        """The limit from this window's pace (not the smoothed one: a limit set in a slow
        warm-up must not outlive it by the smoothing's memory); `ran`: the streams it measured
        (running, with their own pace), or the window's mean streams when it fell back on its interval."""
        self._floor(itl_s)
        target = self.target()
        if target is None:
            return
        gradient = self.mean_streams * target / itl_s
        if itl_s > target:
            if self.mean_streams < 1.5:  # about one stream, slow: not the streams' doing (the prompts beside it)
                return
            self._slow_windows += 1
            self._calm_windows = 0
            if self._slow_windows >= SLOW_WINDOWS:  # one slow window is a pause, not a pace
                self.limit = max(MIN_LIMIT, gradient, self.proven())
            return
        self.proven(ran)
        self._slow_windows = 0
        if self.limit is None:
            return
        if self.mean_streams >= PROBE_AT * self.limit:  # the load presses on the limit: probe up
            self._calm_windows = 0
            self.limit = max(self.limit + max(1.0, PROBE_STEP * self.limit), gradient)
            return
        self._calm_windows += 1  # the load that set the limit has passed
        self.limit = None if self._calm_windows >= CALM_WINDOWS else max(self.limit, gradient)

    def cap(self) -> int | None:
        return None if self.limit is None else max(1, int(self.limit))

    def _advance(self) -> None:
        dt = self._tick()
        if self.streams > 0:
            self._window_s += dt
            self._stream_s += self.streams * dt
