"""Small network helpers."""

from cluster.engine.distributed.ports import free_port

__all__ = ["free_port"]
