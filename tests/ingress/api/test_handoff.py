"""api/grpc_server.py's Handoff: what the front door's loop puts for a call reaches the transport's
loop in order, with one wake-up of that loop for everything put before it ran (one a response, and
one more for the end, were a fifth of the front door's CPU a request)."""

import asyncio
import threading

from router.ingress.api.grpc_server import Handoff


class CountingLoop:
    """A real loop, its thread-safe wake-ups counted."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.wakeups = loop, 0

    def call_soon_threadsafe(self, *args):
        self.wakeups += 1
        return self.loop.call_soon_threadsafe(*args)


def test_items_put_before_the_loop_runs_arrive_in_order_with_one_wakeup():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    got, arrived = [], {n: threading.Event() for n in (3, 5)}

    def deliver(item):
        got.append(item)
        if len(got) in arrived:
            arrived[len(got)].set()

    try:
        gate = threading.Event()
        loop.call_soon_threadsafe(gate.wait, 10)  # the receiving loop is busy until the gate opens
        counting = CountingLoop(loop)
        handoff = Handoff(counting, deliver)
        for i in range(3):
            handoff.put(i)
        assert counting.wakeups == 1 and got == []
        gate.set()
        assert arrived[3].wait(10) and got == [0, 1, 2]
        gate.clear()
        loop.call_soon_threadsafe(gate.wait, 10)
        handoff.put(3)  # after the loop took the first three: a wake-up of its own
        handoff.put(4)
        gate.set()
        assert arrived[5].wait(10) and got == [0, 1, 2, 3, 4] and counting.wakeups == 2
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
