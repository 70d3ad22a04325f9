"""api/grpc_server.py's Handoff: what the front door's loop puts for a call reaches the transport's
loop in order, with one wake-up of that loop for everything put before it ran, whichever calls it is
for (one a response, and one more for the end, were a fifth of the front door's CPU a request; one a
call, a wake-up for each stream a turn of the front door's loop relayed)."""

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
        put = Handoff(counting).sender(deliver)
        for i in range(3):
            put(i)
        assert counting.wakeups == 1 and got == []
        gate.set()
        assert arrived[3].wait(10) and got == [0, 1, 2]
        gate.clear()
        loop.call_soon_threadsafe(gate.wait, 10)
        put(3)  # after the loop took the first three: a wake-up of its own
        put(4)
        gate.set()
        assert arrived[5].wait(10) and got == [0, 1, 2, 3, 4] and counting.wakeups == 2
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_two_calls_items_share_one_wakeup_each_in_its_own_order_and_a_failing_delivery_stops_no_other():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    got: dict[str, list] = {"a": [], "b": []}
    done = threading.Event()

    def deliver_to(call: str):
        def deliver(item):
            if item == "boom":
                raise RuntimeError("a bug in this call's delivery")
            got[call].append(item)
            if item == "end":
                done.set()
        return deliver

    try:
        gate = threading.Event()
        loop.call_soon_threadsafe(gate.wait, 10)  # the receiving loop is busy until the gate opens
        counting = CountingLoop(loop)
        handoff = Handoff(counting)
        a, b = handoff.sender(deliver_to("a")), handoff.sender(deliver_to("b"))
        a(1), b(1), a("boom"), b(2), a(2), b("end")
        assert counting.wakeups == 1
        gate.set()
        assert done.wait(10)
        assert got == {"a": [1, 2], "b": [1, 2, "end"]}
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
