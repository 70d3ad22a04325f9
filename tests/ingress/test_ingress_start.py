"""The ingress replica's async constructor builds its front door off its event loop (issue 52): the
build waits on the control actors (`ray.get` in their `ready`, the rollout's `configure`) and loads
tokenizers, which on the loop stopped it, Serve's health checks of the replica included. No Ray:
the build is observed from outside (the module's `build_front_door`, wrapped), and stops the start."""

import asyncio
import threading

import pytest

import router.ingress.deployment as deployment
from cluster.config import AppConfig


@pytest.mark.filterwarnings("ignore:coroutine .*__del__. was never awaited:RuntimeWarning")  # the unstarted replica
def test_the_front_door_is_built_off_the_event_loop(tiny_model, monkeypatch):
    seen = {}

    def build(config, pools, classifier_handle=None, app=None):
        seen["thread"] = threading.current_thread()
        raise RuntimeError("stop here")  # the rest of the start is not under test

    monkeypatch.setattr(deployment, "build_front_door", build)

    async def start():
        seen["loop_thread"] = threading.current_thread()
        ingress = object.__new__(deployment.Ingress)
        with pytest.raises(RuntimeError, match="stop here"):
            await deployment.Ingress.__init__(ingress, AppConfig(model=tiny_model).model_dump(), {})

    asyncio.run(start())
    assert seen["thread"] is not seen["loop_thread"]
