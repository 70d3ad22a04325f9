"""CUDA events around each graph replay of the engine's static decode path, applied from outside
(the engine's step carries no timing): `with ReplayTimer(static) as t: ...` then `t.events`, one
(rows, start, end) a replay, read once the device is synchronized."""

from __future__ import annotations

import torch


class ReplayTimer:
    def __init__(self, static):
        self.static = static
        self.events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def __enter__(self) -> "ReplayTimer":
        plain = type(self.static)._replay

        def timed(graph, rows: int) -> None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            plain(self.static, graph, rows)
            end.record()
            self.events.append((rows, start, end))

        self.static._replay = timed  # this instance's replays only, until exit
        return self

    def __exit__(self, *exc) -> None:
        del self.static._replay
