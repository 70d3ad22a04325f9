"""gateway/front_door.py RequestIds: 128 random bits an id, as uuid4's hex, the OS read once a batch."""

import os

from router.ingress.gateway import front_door
from router.ingress.gateway.front_door import RequestIds


def test_ids_are_32_hex_digits_distinct_across_batches_and_read_once_a_batch(monkeypatch):
    reads, real = [], os.urandom

    def urandom(n):
        reads.append(n)
        return real(n)

    monkeypatch.setattr(front_door.os, "urandom", urandom)
    ids = RequestIds(batch=4)
    got = [ids.next() for _ in range(10)]
    assert reads == [64, 64, 64]  # ids 1-4, 5-8, 9-10
    assert len(set(got)) == 10
    assert all(len(i) == 32 and set(i) <= set("0123456789abcdef") for i in got)
