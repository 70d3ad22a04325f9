"""The layer rule, checked on every import of the project's own modules (function-local and
type-checking ones too): engine <- serving <- app; kv_transfer and router use the engine layer
only, the planner (cluster.planner) the engine and the router; the front door (router.ingress) is
itself in layers, request/status <- flow <- versions <- gateway <- api <- deployment, and never
imports torch; nothing imports the tools or the app; and
no two modules of the five packages (cluster/, router/, prefill/, decode/, kv_transfer/) import each
other, directly or round a longer circle, relative imports included. And the house's size: no
function over 60 lines and no file over 500 in those packages, benchmark mains included, but for
the exceptions listed below, each with its reason (issue 53)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cluster", "router", "prefill", "decode", "kv_transfer", "protos")

ENGINE = {"cluster.errors", "cluster.engine"}
# layer -> the layers it may import (besides itself). The longest matching prefix names a module's layer.
ALLOWED: dict[str, set[str]] = {
    "protos": set(),
    "cluster.errors": set(),
    "cluster.engine": {"cluster.errors"},
    "kv_transfer": ENGINE,
    "router": ENGINE,
    "cluster.guardrail_rules": set(),
    "cluster.config": ENGINE | {"cluster.guardrail_rules"},
    "cluster.manifest": ENGINE | {"cluster.config"},
    "cluster.telemetry": ENGINE | {"cluster.config", "kv_transfer"},
    "cluster.serving": ENGINE | {"cluster.config", "cluster.telemetry", "kv_transfer", "router"},
    "prefill": ENGINE | {"cluster.config", "cluster.serving", "kv_transfer"},
    "decode": ENGINE | {"cluster.config", "cluster.serving", "kv_transfer"},
    "cluster.planner": ENGINE | {"router"},  # the simulator feeds the router's own policy
    # the front door's own layers, bottom up
    "router.ingress": set(),  # its package file only
    "router.ingress.request": ENGINE,
    "router.ingress.status": ENGINE,
    "router.ingress.flow": (FRONT := ENGINE | {"cluster.config", "router", "router.ingress.request",
                                               "router.ingress.status"}),
    "router.ingress.versions": FRONT | {"router.ingress.flow"},
    "router.ingress.gateway": FRONT | {"router.ingress.flow", "router.ingress.versions", "cluster.telemetry",
                                       "cluster.guardrail_rules"},
    "router.ingress.api": FRONT | {"router.ingress.flow", "router.ingress.gateway", "cluster.telemetry", "protos"},
    "router.ingress.deployment": FRONT | {"router.ingress.flow", "router.ingress.versions", "router.ingress.gateway",
                                          "router.ingress.api", "cluster.telemetry", "protos"},
    "cluster.app": set(ALLOWED_ALL := {"protos", "cluster.errors", "cluster.engine", "kv_transfer", "router",
                                       "cluster.config", "cluster.guardrail_rules", "cluster.manifest", "cluster.telemetry", "cluster.serving",
                                       "prefill", "decode", "router.ingress", "router.ingress.request",
                                       "router.ingress.status", "router.ingress.flow", "router.ingress.versions",
                                       "router.ingress.gateway", "router.ingress.api", "router.ingress.deployment",
                                       "cluster.planner"}),
    "cluster.tools": ALLOWED_ALL | {"cluster.app"},
}

# The one sanctioned exception: `pdserve bench` is a subcommand of the CLI, which hands it over to
# the load generator's own parser (lazily, at start-up), so the tools stay out of every server.
EXCEPTIONS = {("cluster.app.bench_cli", "cluster.tools.loadgen.cli")}


def layer_of(module: str) -> str | None:
    best = None
    for layer in ALLOWED:
        if (module == layer or module.startswith(layer + ".")) and (best is None or len(layer) > len(best)):
            best = layer
    return best


def absolute(node: ast.ImportFrom, package: str) -> str:
    """The module an ImportFrom names, a relative one resolved against `package` (the importing
    module's package: itself for an __init__)."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    return ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))


def imported_modules(tree: ast.AST, package: str = "") -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            found += [(node.lineno, f"{absolute(node, package)}.{a.name}") for a in node.names]
    return [(line, m) for line, m in found if m.split(".")[0] in PACKAGES]


def violations(path: str, source: str) -> list[str]:
    module = ".".join(Path(path).with_suffix("").parts).removesuffix(".__init__")
    package = module if Path(path).name == "__init__.py" else module.rpartition(".")[0]
    own = layer_of(module)
    if own is None and module in PACKAGES:  # a top-level package's __init__: imports nothing of ours
        own = module
        ALLOWED.setdefault(own, set())
    if own is None:
        return [f"{path}: module {module} belongs to no layer (add it to tests/test_layers.py)"]
    bad = []
    for line, target in imported_modules(ast.parse(source), package):
        theirs = layer_of(target)
        if (module, target.rpartition(".")[0]) in EXCEPTIONS:
            continue
        if theirs is not None and theirs != own and theirs not in ALLOWED[own]:
            bad.append(f"{path}:{line}: {own} imports {target} ({theirs})")
    return bad


def project_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name)


def test_no_module_imports_a_higher_layer():
    bad = [v for p in project_files() for v in violations(str(p.relative_to(ROOT)), p.read_text())]
    assert bad == []


@pytest.mark.parametrize("path, source, expected", [
    ("cluster/engine/scheduler.py", "from router.policy import RouteDecision",
     ["cluster/engine/scheduler.py:1: cluster.engine imports router.policy.RouteDecision (router)"]),
    ("router/policy.py", "def f():\n    from router.ingress.flow.request_flow import RequestFlow",
     ["router/policy.py:2: router imports router.ingress.flow.request_flow.RequestFlow (router.ingress.flow)"]),
    ("router/ingress/flow/legs.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    "    from router.ingress.gateway.stages import Outcome",
     ["router/ingress/flow/legs.py:3: router.ingress.flow imports router.ingress.gateway.stages.Outcome "
      "(router.ingress.gateway)"]),
    ("router/ingress/api/grpc_api.py", "from router.ingress.versions.catalog import ModelCatalog",
     ["router/ingress/api/grpc_api.py:1: router.ingress.api imports router.ingress.versions.catalog.ModelCatalog "
      "(router.ingress.versions)"]),
    ("router/ingress/gateway/stages.py", "from router.ingress.flow.request_flow import RequestFlow", []),
    ("kv_transfer/handle.py", "import cluster.serving.replica",
     ["kv_transfer/handle.py:1: kv_transfer imports cluster.serving.replica (cluster.serving)"]),
    ("cluster/serving/replica.py", "from cluster.tools.netutil import free_port",
     ["cluster/serving/replica.py:1: cluster.serving imports cluster.tools.netutil.free_port (cluster.tools)"]),
    ("decode/engine.py", "from cluster.engine import llm_engine\nfrom kv_transfer.handle import KVHandle", []),
    ("cluster/planner/simulator.py", "from router.policy import RoutingPolicy", []),
    ("cluster/planner/plan.py", "from cluster.serving.replica import EngineReplica",
     ["cluster/planner/plan.py:1: cluster.planner imports cluster.serving.replica.EngineReplica (cluster.serving)"]),
    ("cluster/serving/replica.py", "import cluster.planner.plan",
     ["cluster/serving/replica.py:1: cluster.serving imports cluster.planner.plan (cluster.planner)"]),
    # relative imports, resolved against the importing module's package
    ("cluster/engine/scheduler.py", "from ..serving.replica import EngineReplica",
     ["cluster/engine/scheduler.py:1: cluster.engine imports cluster.serving.replica.EngineReplica (cluster.serving)"]),
    ("kv_transfer/__init__.py", "from .transport import NixlTransport", []),
    ("router/ingress/flow/__init__.py", "from ..gateway import stages",
     ["router/ingress/flow/__init__.py:1: router.ingress.flow imports router.ingress.gateway.stages "
      "(router.ingress.gateway)"]),
])
def test_the_rule_catches_an_upward_import(path, source, expected):
    assert violations(path, source) == expected


def test_the_front_door_never_imports_torch():
    code = ("import sys\n"
            "import router.ingress.deployment, router.ingress.gateway.front_door, router.ingress.api.openai_api\n"
            "import router.ingress.api.grpc_api, router.ingress.gateway.admission_actor, router.ingress.api.probes\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_what_the_engines_send_the_front_door_unpickles_without_torch():
    """A class's module is imported where its instance is unpickled: a prefill result defined beside
    the engine made every ingress import torch and the engine at its first request (~860 modules,
    walked by every later full garbage collection)."""
    import pickle

    from cluster.engine.outputs import RequestOutput
    from kv_transfer.handle import KVHandle
    from prefill.result import PrefillResult

    sent = pickle.dumps([PrefillResult, RequestOutput, KVHandle])  # by reference, as instances are
    code = ("import pickle, sys\n"
            f"pickle.loads({sent!r})\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'cluster.engine.llm'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"



def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports (any import: top level, in a function, under
    TYPE_CHECKING; relative ones resolved). `sources`: module name -> its source."""
    graph = {}
    for module, source in sources.items():
        package = module if module in PACKAGE_MODULES else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(source)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                while name and name not in sources:
                    name = name.rpartition(".")[0]
                if name and name != module and not module.startswith(name + "."):
                    found.add(name)
        graph[module] = found
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected set of more than one module (Tarjan), sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                out.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


PACKAGE_MODULES: set[str] = set()  # modules that are packages (their __init__): relative imports start there


def project_sources(roots=("cluster", "router")) -> dict[str, str]:
    sources = {}
    for root in roots:
        for p in (ROOT / root).rglob("*.py"):
            if "_pb2" in p.name:
                continue
            module = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            if module.endswith(".__init__"):
                module = module.removesuffix(".__init__")
                PACKAGE_MODULES.add(module)
            sources[module] = p.read_text()
    return sources


LAYERED = ("cluster", "router", "prefill", "decode", "kv_transfer")  # the packages the house rules hold in


def test_no_import_cycle_in_any_package():
    assert import_cycles(import_graph(project_sources(LAYERED))) == []


def test_a_cycle_through_a_relative_import_is_found():
    PACKAGE_MODULES.add("kv_transfer")
    sources = {"kv_transfer": "", "kv_transfer.a": "from .b import B", "kv_transfer.b": "from . import a",
               "decode.engine": "from kv_transfer.a import A"}
    assert import_cycles(import_graph(sources)) == [["kv_transfer.a", "kv_transfer.b"]]


def test_a_cycle_through_a_type_checking_import_is_found():
    sources = {"router.a": "from router.b import B", "router.b": "import router.c",
               "router.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from router.a import A",
               "router.d": "from router.a import A"}
    assert import_cycles(import_graph(sources)) == [["router.a", "router.b", "router.c"]]


MAX_FUNCTION_LINES = 60  # a longer one is two jobs (issue 38; every package since issue 53)
MAX_FILE_LINES = 500  # a longer file is two concepts: split it by concept

BENCH_MAIN = ("a benchmark's driver (arguments, then its arms in order, then the table), run by hand, on "
              "no serving path; split when it is next changed (issue 53)")
# "path:function" -> why it may be longer for now. An entry that no longer applies fails the test.
LONG_FUNCTIONS = {
    "cluster/tools/bench/admission.py:bench_burst": BENCH_MAIN,
    "cluster/tools/bench/admission.py:bench_noisy": BENCH_MAIN,
    "cluster/tools/bench/admission.py:main": BENCH_MAIN,
    "cluster/tools/bench/audit.py:main": BENCH_MAIN,
    "cluster/tools/bench/engine.py:main": BENCH_MAIN,
    "cluster/tools/bench/front_door.py:main": BENCH_MAIN,
    "cluster/tools/bench/grammar_libs.py:run": BENCH_MAIN,
    "cluster/tools/bench/guardrails.py:main": BENCH_MAIN,
    "cluster/tools/bench/models.py:main": BENCH_MAIN,
    "cluster/tools/bench/plan_validation.py:main": BENCH_MAIN,
    "cluster/tools/bench/routing.py:run_arm": BENCH_MAIN,
    "cluster/tools/bench/spec.py:main": BENCH_MAIN,
    "cluster/tools/bench/tiers.py:main": BENCH_MAIN,
    "cluster/tools/bench/ttft_tpot.py:main": BENCH_MAIN,
    "cluster/tools/loadgen/cli.py:add_bench_parser": "`pdserve bench`'s flags, one add_argument each (a table, "
                                                     "not logic); split when the load generator next changes",
    "cluster/tools/loadgen/cli.py:_bench": BENCH_MAIN,
    "cluster/tools/loadgen/runner.py:run": BENCH_MAIN,
}
LONG_FILES: dict[str, str] = {}  # path -> why it may be longer for now (none: every file is within the rule)


def long_functions(roots=LAYERED) -> dict[str, int]:
    """"path:function" -> its lines, for each function over MAX_FUNCTION_LINES (methods and nested ones too)."""
    return {f"{p.relative_to(ROOT)}:{node.name}": node.end_lineno - node.lineno + 1
            for root in roots for p in sorted((ROOT / root).rglob("*.py")) if "_pb2" not in p.name
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}


def long_files(roots=LAYERED) -> dict[str, int]:
    return {str(p.relative_to(ROOT)): n for root in roots for p in sorted((ROOT / root).rglob("*.py"))
            if "_pb2" not in p.name and (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}


def test_no_function_in_any_package_is_longer_than_sixty_lines():
    found = long_functions()
    assert {k: v for k, v in found.items() if k not in LONG_FUNCTIONS} == {}
    assert sorted(set(LONG_FUNCTIONS) - set(found)) == []  # an exception no longer needed goes


def test_no_file_in_any_package_is_longer_than_five_hundred_lines():
    found = long_files()
    assert {k: v for k, v in found.items() if k not in LONG_FILES} == {}
    assert sorted(set(LONG_FILES) - set(found)) == []


def test_the_size_checks_see_a_long_function_and_file(tmp_path, monkeypatch):
    """A method of 61 lines is found, a function of exactly 60 is not; a file of 501 lines is."""
    pkg = tmp_path / "cluster"
    pkg.mkdir()
    method = ["class A:", "    def m(self):"] + [f"        x{i} = {i}" for i in range(60)]  # m: 61 lines
    function = ["def f():"] + [f"    y{i} = {i}" for i in range(59)]  # f: 60 lines
    lines = method + [""] * (501 - len(method) - len(function)) + function
    (pkg / "big.py").write_text("\n".join(lines) + "\n")
    (pkg / "small.py").write_text("\n".join(lines[:500]) + "\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert long_functions(("cluster",)) == {"cluster/big.py:m": 61, "cluster/small.py:m": 61}
    assert long_files(("cluster",)) == {"cluster/big.py": 501}
