"""An engine's measured step costs and their curves (no torch: the simulator and the plan read it).

Each cost is a 2-D grid of measured step times, interpolated piecewise-linearly along each axis
(bilinear inside a cell). Nothing is extrapolated: a point beyond an axis' largest measured value
raises `OutOfRange` naming the axis and the calibrated range. Below an axis' smallest value the
smallest is used (step times grow with tokens, batch and context, so that over-estimates: the
simulator counts those lookups, `Curve.clamped_low`).

    prefill step(tokens computed, context before them)      seconds
    decode step(batch, mean context per request)            seconds

A step mixing decodes and prompt chunks (a decode replica prefilling locally) is one forward over
all its rows, as the engine runs it (model_runner: the decode rows, then the chunks, one batch): it
is priced as a prefill step of the chunks' tokens plus one token per decode row, plus the decode
rows' attention over their own context (the decode curve's rise from its smallest context to
theirs), `Profile.mixed_step`. (Priced as the sum of a decode step and a prefill step, as it was to
session 22, it counted the weights' read and the step's fixed cost twice: 8% over the real mixed
steps of a colocated replica near saturation, docs/benchmarks.md, issue 54.) KV transfer is `latency_s + bytes / bytes_per_s` when measured; a profile
without it says so (`transfer is None`).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

FORMAT = "pdserve-profile/1"


class OutOfRange(ValueError):
    """A lookup beyond the calibrated range (the profile refuses to extrapolate)."""


@dataclass
class Curve:
    """f(x, y) measured on the grid xs x ys (values[i][j] = f(xs[i], ys[j])), both axes ascending."""

    name: str
    x_name: str
    y_name: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]
    values: tuple[tuple[float, ...], ...]
    clamped_low: int = field(default=0, compare=False)  # lookups below an axis' first point

    def __post_init__(self):
        self.xs, self.ys = tuple(self.xs), tuple(self.ys)
        self.values = tuple(tuple(float(v) for v in row) for row in self.values)
        if len(self.values) != len(self.xs) or any(len(row) != len(self.ys) for row in self.values):
            raise ValueError(f"{self.name}: values must be {len(self.xs)} x {len(self.ys)}")
        for axis, pts in ((self.x_name, self.xs), (self.y_name, self.ys)):
            if not pts or any(b <= a for a, b in zip(pts, pts[1:])):
                raise ValueError(f"{self.name}: {axis} points must be strictly ascending, got {pts}")

    def _cell(self, axis: str, pts: tuple[float, ...], v: float) -> tuple[int, float]:
        """(i, w): v lies between pts[i] and pts[i+1] at fraction w (one point: (0, 0))."""
        if v > pts[-1]:
            raise OutOfRange(f"{self.name}: {axis}={v:g} is beyond the calibrated range "
                             f"[{pts[0]:g}, {pts[-1]:g}] (profile with a larger grid)")
        if v <= pts[0]:
            if v < pts[0]:
                self.clamped_low += 1
            return 0, 0.0
        i = bisect.bisect_left(pts, v) - 1
        return i, (v - pts[i]) / (pts[i + 1] - pts[i])

    def __call__(self, x: float, y: float) -> float:
        i, wx = self._cell(self.x_name, self.xs, x)
        j, wy = self._cell(self.y_name, self.ys, y)
        v = self.values
        i1, j1 = min(i + 1, len(self.xs) - 1), min(j + 1, len(self.ys) - 1)
        top = v[i][j] * (1 - wy) + v[i][j1] * wy
        bottom = v[i1][j] * (1 - wy) + v[i1][j1] * wy
        return top * (1 - wx) + bottom * wx

    def scaled(self, factor: float) -> "Curve":
        """The same curve with every step time times `factor` (the plan's what-if relaxations)."""
        return Curve(self.name, self.x_name, self.y_name, self.xs, self.ys,
                     [[v * factor for v in row] for row in self.values])

    def covers(self, x: float, y: float) -> bool:
        return x <= self.xs[-1] and y <= self.ys[-1]

    def to_json(self) -> dict:
        return {"x": self.x_name, "y": self.y_name, "xs": list(self.xs), "ys": list(self.ys),
                "step_s": [list(r) for r in self.values]}

    @classmethod
    def from_json(cls, name: str, d: dict) -> "Curve":
        return cls(name, d["x"], d["y"], d["xs"], d["ys"], d["step_s"])


@dataclass(frozen=True)
class Transfer:
    """KV pull time against bytes: latency_s + bytes / bytes_per_s (fitted to measured points)."""

    latency_s: float
    bytes_per_s: float
    measured: bool = True  # False: given on the command line, not measured on this machine

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Serving:
    """What the serving path adds to the engine's steps, measured through a real `pdserve up`
    (cluster/tools/bench/serving_probe.py): the client's TTFT over the simulated one, per path
    (local: the decode replica prefills; remote: a prefill replica does, one more hop); a decode
    step's time over the profiled one, fixed and per running stream (the replica's loop streaming
    each stream's delta through Ray, beside the engine's thread); the remote path's hand-off (its
    first gap over a decode step: the pull and the hop); and the CPU the serving processes (the
    ingress, the router, the proxy, each replica's loop beside its engine thread) spend per relayed
    token, which on shared cores they take from the engines (`ClusterConfig.cores`)."""

    ttft_local_s: float
    ttft_remote_s: float
    decode_step_s: float  # per decode step
    decode_stream_s: float  # per stream in a decode step
    handoff_s: float
    message_cpu_s: float = 0.0  # CPU seconds per relayed token (requests' own costs spread over theirs)
    probe: dict = field(default_factory=dict)  # what was run to measure them


@dataclass
class Profile:
    model: dict  # path, identity, shape
    device: dict  # kind, name, threads
    versions: dict  # torch, pdserve, python
    engine: dict  # block_size, dtype, kv_block_bytes, max_num_seqs ...
    prefill: Curve  # step_s(tokens, cached)
    decode: Curve  # step_s(batch, context)
    transfer: Transfer | None = None
    notes: tuple[str, ...] = ()
    created: str = ""
    wall_s: float = 0.0
    serving: Serving | None = None  # None: the engine's steps alone (the serving path costs nothing)
    # Measured on this machine (`pdserve profile --sharing N`): a step's time over its time alone
    # while n engine processes step at once, for n = 1, 2, ...: what `ClusterConfig.cores` prices
    # with. () : not measured (then n / cores, processor sharing of ideal cores).
    sharing: tuple[float, ...] = ()

    def slowdown(self, n: int, cores: float) -> float:
        """A step's time over its profiled time while n steps run at once on `cores` shared cores:
        the measured factor for n, beyond the measured range that of the largest n scaled by n / it."""
        if n <= 1:
            return 1.0
        if not self.sharing:
            return max(1.0, n / cores)
        k = min(n, len(self.sharing))
        return max(1.0, self.sharing[k - 1]) * n / k  # a factor measured under 1 is noise: none

    def uncalibrated(self) -> list[str]:
        """What this profile lacks for a plan to be trusted on the machine it was made on (empty:
        nothing): the serving path's cost, the engines' sharing of a CPU machine's cores, the KV
        transfer measured or stated as assumed."""
        missing = []
        if self.serving is None:
            missing.append("the serving path's cost (per request, step, stream and relayed token)")
        if self.device.get("kind") == "cpu" and not self.sharing:
            missing.append("the engine processes' sharing of the cores")
        if self.transfer is None:
            missing.append("the KV transfer (neither measured nor stated as assumed)")
        return missing

    def mixed_step(self, chunk_tokens: int, chunk_context: float, batch: int, context: float) -> float:
        """Seconds of one step computing `chunk_tokens` prompt tokens after `chunk_context` (token-
        weighted) and `batch` decodes at mean context `context`: one forward over chunk_tokens + batch
        rows (the step's fixed cost and the weights' read once), plus the decodes' attention over
        their own KV, which no prompt token shares: decode(batch, context) - decode(batch, smallest
        context) (0 at or below it)."""
        seconds = self.prefill(chunk_tokens + batch, chunk_context)
        if batch and context > self.decode.ys[0]:
            seconds += max(0.0, self.decode(batch, context) - self.decode(batch, self.decode.ys[0]))
        return seconds

    @property
    def block_size(self) -> int:
        return int(self.engine["block_size"])

    @property
    def kv_bytes_per_token(self) -> float:
        return self.engine["kv_block_bytes"] / self.block_size

    def scaled(self, prefill: float = 1.0, decode: float = 1.0) -> "Profile":
        return replace(self, prefill=self.prefill.scaled(prefill), decode=self.decode.scaled(decode))

    def range_text(self) -> str:
        p, d = self.prefill, self.decode
        return (f"prefill: <= {p.xs[-1]:g} tokens per step after <= {p.ys[-1]:g} context; "
                f"decode: batch <= {d.xs[-1]:g}, context <= {d.ys[-1]:g}")

    def to_json(self) -> dict:
        return {"format": FORMAT, "model": self.model, "device": self.device, "versions": self.versions,
                "engine": self.engine, "prefill": self.prefill.to_json(), "decode": self.decode.to_json(),
                "transfer": None if self.transfer is None else asdict(self.transfer),
                "notes": list(self.notes), "created": self.created, "wall_s": self.wall_s,
                **({} if self.serving is None else {"serving": asdict(self.serving)}),
                **({"sharing": list(self.sharing)} if self.sharing else {})}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, d: dict) -> "Profile":
        if d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file (format={d.get('format')!r})")
        t, sv = d.get("transfer"), d.get("serving")
        return cls(d["model"], d["device"], d["versions"], d["engine"],
                   Curve.from_json("prefill", d["prefill"]), Curve.from_json("decode", d["decode"]),
                   None if t is None else Transfer(**t), tuple(d.get("notes", ())), d.get("created", ""),
                   d.get("wall_s", 0.0), None if sv is None else Serving(**sv), tuple(d.get("sharing", ())))

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return cls.from_json(json.loads(Path(path).read_text()))
