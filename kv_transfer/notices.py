"""Lease notices, decode -> prefill: "done:<request id>" (the READ is over: reuse the blocks now)
and "release:<request id>" (not pulling, but a READ of ours may still read them: wait the grace).

Decode sends them from a NIXL agent of their own, never from the agent that posts the READs.
NIXL's UCX backend flushes the endpoint after posting a READ's gets, and after a notification went
out on that endpoint (over TCP: the lane UCX carries notifications on, CPU and GPU pools alike) the
flush waits for the peer's process to progress UCX. So with the notice on the READ (notif_msg, or
send_notif on the same agent) every pull after the first waited on the prefill's loop: 1.5-6 ms on
a 2-core CPU whatever the size, ~1.7 ms on an H200, 100 ms beside a peer polling every 100 ms
(docs/benchmarks.md, "The engine pull's fixed cost"). An agent that posts no transfers is never
flushed, and the READ's endpoint carries nothing but READs.

The notices agent holds no memory; it is made on the first peer (prefill engines never make one).
A notice is best effort: if it is lost, the lease expires and prefill keeps the blocks for its
grace period before reuse.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

DONE, RELEASE = "done", "release"


def encode(kind: str, request_id: str) -> bytes:
    return f"{kind}:{request_id}".encode()


@dataclass(frozen=True)
class LeaseNotices:
    """Prefill side: request ids whose READ completed (`done`: the blocks may be reused now), and
    ids a decode engine let go of while a READ of its may still be reading (`released`: reuse
    only after the grace period)."""

    done: list[str]
    released: list[str]

    @staticmethod
    def parse(notifs: dict[str, list[bytes]]) -> "LeaseNotices":
        """From nixl_agent.get_new_notifs() (peer agent name -> messages)."""
        done, released = [], []
        for msgs in notifs.values():
            for m in msgs:
                kind, _, rid = m.decode(errors="replace").partition(":")
                if kind == DONE:
                    done.append(rid)
                elif kind == RELEASE:
                    released.append(rid)
        return LeaseNotices(done, released)


class NoticeSender:
    """Decode side: a NIXL agent that only sends lease notices to the prefill agents it knows."""

    def __init__(self, agent_name: str):
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415 — lazy: heavy import

        # No progress thread (it spins a core): the decode loop progresses it every turn (progress()).
        self.agent = nixl_agent(agent_name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))

    def add_peer(self, agent_metadata: bytes) -> str:
        name = self.agent.add_remote_agent(agent_metadata)
        return name.decode() if isinstance(name, bytes) else name

    def remove_peer(self, agent_name: str) -> None:
        self.agent.remove_remote_agent(agent_name)

    def send(self, notices: list[tuple[str, str, str]]) -> None:
        """Best effort, each (peer agent name, kind, request id): posted now and pushed once; what
        UCX could not send yet goes out as the decode loop progresses this agent (every turn)."""
        for agent_name, kind, request_id in notices:
            try:
                self.agent.send_notif(agent_name, encode(kind, request_id))
            except Exception as e:  # noqa: BLE001 — a lost notice ends in the lease's expiry
                log.debug("%s notice for %s to %s not sent: %s", kind, request_id, agent_name, e)
        self.progress()

    def progress(self) -> None:
        """Push out notices UCX has not sent yet (it sends only while its worker progresses)."""
        try:
            self.agent.get_new_notifs()  # it receives none; this only makes progress
        except Exception as e:  # noqa: BLE001
            log.debug("UCX progress (notices): %s", e)
