"""A replica's role (cluster/serving/replica.py): which one it plays now, the role object its loop
drives, and the specs of the roles it may play. A flip builds the new role's object over the same
engine and transport: the old object, and all it measured (its leases, pulls and counters), goes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

from cluster.config import AppConfig
from cluster.errors import WrongRoleError

if TYPE_CHECKING:
    from cluster.engine.llm_engine import LLMEngine
    from kv_transfer.transport import NixlTransport

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class RoleSpec:
    """How a replica plays one role. `make(engine, transport, config)` builds the role object the
    loop drives (prefill/deployment.py, decode/deployment.py); `idle_poll_s`: the loop's idle
    wake-up while it plays it (prefill's serve lease expiry and notices)."""

    make: Callable[[LLMEngine, NixlTransport, AppConfig], Any]
    idle_poll_s: float | None = None


class PlayedRole:
    def __init__(self, specs: Mapping[Role, RoleSpec], name: Role, engine, transport, config: AppConfig):
        self.specs: dict[Role, RoleSpec] = dict(specs)
        self.engine, self.transport, self.config = engine, transport, config
        self.name: Role = name
        self.obj = specs[name].make(engine, transport, config)

    def playing(self, role: Role, replica_id: str):
        """The role object, if the replica plays `role` now (else WrongRoleError). Loop thread
        only: a flip swaps the role there too, so a call is checked and started against one role."""
        if self.name != role:
            raise WrongRoleError(f"replica {replica_id} plays {self.name} now, not {role}")
        return self.obj

    def swap(self, role: Role) -> RoleSpec:
        """Loop thread, the old role drained: play `role` with a new role object."""
        spec = self.specs[role]
        self.obj = spec.make(self.engine, self.transport, self.config)
        self.name = role
        return spec
