"""The control actors' names, scopes and handles, and the router as a named Ray actor (a thin shell
over router.router.Router).

**Scope.** Every control actor belongs to one Serve app: its name is `app/kind` (admission, ledger,
audit writer, rollout) or `app/router/group` (a router per model version, AppConfig.serving_group),
in the `pdserve` namespace, so two apps on one Ray cluster, even serving the same model, share no
loads, prefix index, sessions, quotas or splits. A caller learns its app from the Serve replica it
runs in (serve_app); outside a replica (the CLI, a benchmark, a test) it is DEFAULT_APP, the app
`pdserve up` deploys. The registry (cluster/serving/registry.py) stays one per cluster: it maps
engine ids, unique across apps, to their NIXL identity.

**Options.** Ray restarts a dead actor (`max_restarts=-1`) by re-running `__init__` with its
creation arguments, which are those of whoever asked first, not the app's current config. So an
actor's options live in the GCS key-value store under its name: a fresh actor keeps its arguments
there, `configure()` replaces them (the app redeployed with other options: applied, or refused with
an error naming the option), and a restarted actor reads them back (restored). The router keeps its
policy the same way (it is created by a replica, which knows no policy; the ingress configures it).
The GCS outlives every actor; it goes with the Ray cluster.

**Handles.** Callers hold an ActorRef, not a handle: after the actor died for good (killed without
restart, its creation failed) the next call gets (or creates) it again, with the caller's options.
Only a call may create an actor; finalizers and the replica-death hooks look one up (lookup), so
nothing creates an empty actor that nobody feeds."""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote

import ray
from ray.experimental import internal_kv

from router.channel import ChannelDown, ChannelServer, RouterChannel, ChannelMethod, locked, positional
from router.policy import PolicyConfig
from router.router import Router

log = logging.getLogger(__name__)

NAMESPACE = "pdserve"
DEFAULT_APP = "pdserve"  # the Serve app `pdserve up` deploys (cluster/app/builder.py)
ROUTER = "router"


def serve_app() -> str:
    """The Serve app of the replica this runs in; DEFAULT_APP outside one."""
    from ray import serve  # noqa: PLC0415
    from ray.serve.exceptions import RayServeException  # noqa: PLC0415

    try:
        return serve.get_replica_context().app_name
    except RayServeException:
        return DEFAULT_APP


def scoped_name(app: str, kind: str, *parts: str) -> str:
    """`app/kind[/part...]`, each quoted (a `/` in an app or model name cannot make two scopes one)."""
    return "/".join(quote(p, safe="@.-_:") for p in (app, kind, *parts))


def router_name(app: str, group: str, cell: int | None = None) -> str:
    """The router of one model version (AppConfig.serving_group) of one app, or of one of its
    cells (router/cells.py): `app/router/group/cell-K`."""
    return scoped_name(app, ROUTER, group) if cell is None else scoped_name(app, ROUTER, group, f"cell-{cell}")


def _key(name: str) -> bytes:
    return f"pdserve-options/{name}".encode()


def keep(options: Any) -> None:
    """Inside a named actor: `options` are what it runs with now (read back by `restored` after a restart)."""
    name = ray.get_runtime_context().get_actor_name()
    if name:
        internal_kv._internal_kv_put(_key(name), pickle.dumps(options), overwrite=True, namespace=NAMESPACE)


def saved(name: str) -> Any:
    """The options kept under this actor name; None if none were."""
    raw = internal_kv._internal_kv_get(_key(name), namespace=NAMESPACE)
    return None if raw is None else pickle.loads(raw)


def restored(options: Any) -> Any:
    """In a named actor's `__init__`: after a restart by Ray, the options it last ran with (its last
    configure()'s); else `options`, kept now. An unnamed actor (a test's) keeps nothing."""
    ctx = ray.get_runtime_context()
    name = ctx.get_actor_name()
    if name and ctx.was_current_actor_reconstructed:
        last = saved(name)
        if last is not None:
            return last
    keep(options)
    return options


WATCH_INTERVAL_S = 0.1  # a ref watches one call in this interval for ActorDiedError


class ActorRef:
    """A named control actor, called as a handle is (`ref.method.remote(...)`). `resolve()` gets or
    creates the actor and returns its handle; after a call of this ref meets ActorDiedError (the
    actor is gone for good: a restart is ActorUnavailableError, and the same handle reaches the
    restarted actor), the next call resolves it again. One call per WATCH_INTERVAL_S is watched
    (a completion callback costs tens of microseconds; the router's `route` is on every request's
    path), so calls to a dead actor fail for at most that long plus one call."""

    def __init__(self, name: str, resolve: Callable[[], Any]):
        self.name = name
        self._resolve = resolve
        self._handle = None
        self._watched_at = float("-inf")
        self.resolutions = 0  # handles got so far (1 while the first actor lives)

    def handle(self):
        handle = self._handle
        if handle is None:
            handle = self._handle = self._resolve()
            self.resolutions += 1
        return handle

    def __getattr__(self, method: str) -> "_Method":
        if method.startswith("_"):
            raise AttributeError(method)
        return _Method(self, method)

    def _watch(self, handle, ref) -> None:
        now = time.monotonic()
        if now - self._watched_at < WATCH_INTERVAL_S:
            return
        self._watched_at = now

        def done(result) -> None:
            if isinstance(result, ray.exceptions.ActorDiedError) and self._handle is handle:
                log.info("control actor %s died; the next call resolves it again", self.name)
                self._handle = None

        ref._on_completed(done)

    def existing(self):
        """The handle this ref holds, else the live actor's; None when there is none (never creates)."""
        return self._handle or lookup(self.name)


class _Method:
    __slots__ = ("_ref", "_name")

    def __init__(self, ref: ActorRef, name: str):
        self._ref, self._name = ref, name

    def remote(self, *args, **kwargs):
        handle = self._ref.handle()
        ref = getattr(handle, self._name).remote(*args, **kwargs)
        self._ref._watch(handle, ref)
        return ref


def named_actor(actor_class, name: str, *args, namespace: str = NAMESPACE, options: dict | None = None,
                **kwargs):
    """The cluster's one actor of this name, created (detached, with these arguments and actor
    `options`) by whoever asks first; every later caller gets that one, whatever it passes.

    Scheduled outside the caller's placement group: a tensor-parallel Serve replica runs in one
    whose child actors Ray places in it (Serve sets placement_group_capture_child_tasks), and
    Serve removes it with the replica; a control actor placed there would be killed with it and
    stay RESTARTING for good (its bundle is gone), under a name every later caller resolves."""
    opts = {"scheduling_strategy": "DEFAULT", **(options or {})}
    return actor_class.options(name=name, namespace=namespace, get_if_exists=True, lifetime="detached",
                               **opts).remote(*args, **kwargs)


class ConfiguredRef(ActorRef):
    """An ActorRef to a control actor that runs with `settings` (its `configure(settings)`): created
    with them, or, found running with others (the app redeployed with a changed config), given
    them. Each resolution sends them before the ref's first call, so its calls meet the actor
    configured; `ready` waits for the answer (and raises a refusal: an error naming the option)."""

    def __init__(self, actor_class, name: str, settings, options: dict | None = None):
        self.settings = settings
        self._class, self._options = actor_class, options
        super().__init__(name, self._create)

    def _create(self):
        handle = named_actor(self._class, self.name, self.settings, options=self._options)
        handle.configure.remote(self.settings)
        return handle

    def ready(self, timeout_s: float):
        """The actor's configure() answered: it runs with these settings (raises what it raised)."""
        return ray.get(self.configure.remote(self.settings), timeout=timeout_s)


def lookup(name: str, namespace: str = NAMESPACE):
    """The live actor of this name, or None (never creates one)."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def app_actor_names(app: str, kind: str | None = None) -> list[str]:
    """The control actors of one app (of one kind: the one named `app/kind`, e.g. its ledger, and
    those named `app/kind/...`, e.g. a router per model version) alive now."""
    prefix = scoped_name(app, kind, "") if kind else scoped_name(app, "")
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and (a["name"].startswith(prefix) or a["name"] == prefix[:-1]))


def kill_app_actors(app: str) -> list[str]:
    """End an app's control actors (the app was deleted): the next deploy starts them with its config."""
    names = app_actor_names(app)
    for name in names:
        handle = lookup(name)
        if handle is not None:
            ray.kill(handle, no_restart=True)
    return names


LOCK_WAIT_S = 2.0  # a writer killed for good may free its name just before its process (and lock) is gone


class Exclusive:
    """An exclusive lock (flock) on `path`, held by this process while it writes what the lock
    guards (an audit log's directory, a ledger's file): two apps' actors never write one file.
    Refused with a ValueError naming the `option` when another process holds it past LOCK_WAIT_S."""

    def __init__(self, path: Path, option: str, wait_s: float = LOCK_WAIT_S):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self._fd = path, os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self._fd)
                    raise ValueError(f"{option}: {path} is held by another pdserve process (another app's "
                                     f"writer, or one still ending after {wait_s:g} s): give each app its own "
                                     f"{option}") from None
                time.sleep(0.05)  # polling the lock: flock has no bounded blocking wait

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None


# ---- the router -------------------------------------------------------------------------------------

@ray.remote(num_cpus=0, max_restarts=-1)
@locked
class RouterActor(Router):
    """A router created by whoever asks first (usually a replica, which knows no policy) takes the
    policy its ingress last configured under its name; configure() keeps the new one there.
    Its `route` and `price` are also served on a channel of its own (router/channel.py), started
    by the first `channel_address` call; every public method holds the router's lock (`locked`)."""

    def __init__(self, **kwargs):
        self._lock = threading.RLock()
        self._channel: ChannelServer | None = None
        super().__init__(**kwargs)
        name = ray.get_runtime_context().get_actor_name()
        policy = saved(name) if name else None
        if policy is not None:
            super().configure(*policy)

    def configure(self, config: PolicyConfig, strategy: str = "cost") -> None:
        super().configure(config, strategy)  # validates the strategy before it is kept
        keep((config, strategy))

    def channel_address(self) -> dict:
        """Where this router's channel listens ({node, unix, host, port, token}); starts it."""
        if self._channel is None:
            self._channel = ChannelServer(self, ray.util.get_node_ip_address(),
                                          ray.get_runtime_context().get_node_id())
        return self._channel.address

    def channel_calls(self) -> int:
        """Calls served on the channel since this router started."""
        return 0 if self._channel is None else self._channel.calls


class RouterRef(ActorRef):
    """The ingress's ref to a router: `route.remote(...)` and `price.remote(...)` give awaitables
    answered over the router's channel when it is up (router/channel.py), else as Ray calls (as
    ActorRef's); every other method is ActorRef's. Its calls must be awaited on an event loop."""

    def __init__(self, name: str, resolve: Callable[[], Any]):
        super().__init__(name, resolve)
        self.channel = RouterChannel(self)
        self.route = ChannelMethod(self, "route")
        self.price = ChannelMethod(self, "price")

    async def channel_call(self, method: str, args: tuple, kwargs: dict):
        channel = self.channel
        if channel.usable():
            try:
                return await channel.call(method, positional(method, args, kwargs))
            except ChannelDown as e:
                log.debug("router channel: %s; by Ray", e)
        return await _Method(self, method).remote(*args, **kwargs)


def get_router(group: str, app: str | None = None, cell: int | None = None, channel: bool = False) -> ActorRef:
    """The router of one model version (`group`: AppConfig.serving_group) of an app (None: the
    caller's, serve_app), or of one of its cells. Created by its first call; restarted by Ray with
    its policy if it dies (a restarted router refuses each replica's next event batch, and the
    replica resyncs). `channel`: a RouterRef (the ingress's: `route`/`price` over the channel)."""
    name = router_name(app or serve_app(), group, cell)
    return (RouterRef if channel else ActorRef)(name, lambda: named_actor(RouterActor, name))


def tell_routers_forget(app: str, replica_id: str) -> None:
    """A replica of `app` is gone: every router of the app that lives drops it (a replica id is
    unique, so the routers of other versions ignore it). Creates no router."""
    for name in app_actor_names(app, ROUTER):
        handle = lookup(name)
        if handle is not None:
            handle.forget.remote(replica_id)
