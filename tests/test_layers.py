"""The layers of the house: which part of the gpuloom package may import which.

Every .py file of the package is parsed (ast only, nothing is imported) under the import name
setup.py gives it, and every `import` and `from ... import` in it, relative ones and those
inside functions included, is resolved to an absolute module name and checked:

- a service (gpuloom.services.X) imports services.common, the domain, the converters, the
  policies, shimwire and generated stubs, never another service (services/launcher.py, which
  composes them all in one process, excepted) and never a client;
- a client (gpuloom.clients) never imports gpuloom.services, except inside a function of the
  commands that start services (LAZY_SERVICE_IMPORTS);
- code of the gpuloom/ folder (domain, convert, policies, sim, shimwire, ...) never imports a
  service or a client; the domain imports no policy, converter, simulator, gRPC, protobuf or
  numpy (plain data and rules: what every process speaks); the converters no policy or
  simulator; a policy no gRPC, asyncio, protobuf, converter or simulator, and nothing that
  opens sockets, starts threads or processes, or loads a native library (dataclasses in,
  decisions out: the live services and the simulators call the same code); a simulator
  (gpuloom.sim) nothing a policy may not, and no service: it drives the policies on a clock of
  its own;
- no service imports a simulator (the CLI and the benchmarks drive them).

Where code breaks a rule today and another change is to fix it, ALLOWED names it, with the
reason and the issue; the allowance must still be needed (test_every_allowance_is_needed).

docs/architecture.md draws the same rules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Generated protobuf stubs: not ours to check (and git ignores them).
GENERATED = "gpuloom.v1"
# Client modules that start services (`gpuloom serve`, `gpuloom up`): they may import the
# launcher, lazily (inside a function), so that the rest of the CLI loads no service code.
LAZY_SERVICE_IMPORTS = frozenset({"gpuloom.clients.cli.serve"})
LAUNCHER = "gpuloom.services.launcher"
SERVICES_COMMON = "gpuloom.services.common"
SIM = "gpuloom.sim"
# What a policy or a simulator may not touch: the network, threads and other processes.
SOCKETS_AND_THREADS = (
    "socket",
    "socketserver",
    "ssl",
    "selectors",
    "http",
    "urllib",
    "threading",
    "_thread",
    "multiprocessing",
    "concurrent",
    "subprocess",
)
# (importing module, imported module) -> why it is allowed for now, and the issue that ends it.
ALLOWED: dict[tuple[str, str], str] = {
    ("gpuloom.policies.fikit.core", "ctypes"): (
        "the FIKIT decision core is the shim's C code (shim/src/fikit.c, libglfikit.so), bound "
        "in-process so that the dispatcher and the simulator run what the shim runs; issue 35 "
        "(one native admission engine) reshapes that engine and decides where its binding lives"
    ),
}


def package_roots() -> dict[str, str]:
    """setup.py's PACKAGE_ROOTS (import prefix -> folder), read without running setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "PACKAGE_ROOTS" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no PACKAGE_ROOTS")


def package_modules() -> dict[str, Path]:
    """Import name -> file, for every .py file of the package."""
    modules: dict[str, Path] = {}
    for prefix, folder in package_roots().items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([prefix, *parts])
            if name == GENERATED or name.startswith(GENERATED + "."):
                continue
            modules[name] = path
    return modules


@dataclass(frozen=True)
class Import:
    target: str  # absolute module name (or module.attribute for `from m import attribute`)
    line: int
    lazy: bool  # inside a function


def imports_of(source: str, module: str, path: str) -> Iterator[Import]:
    """Every import of the source, resolved against the module's own name."""
    tree = ast.parse(source, filename=path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]

    def visit(node: ast.AST, lazy: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(alias.name, child.lineno, lazy)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    up = child.level - 1
                    if up >= len(parts):
                        raise ValueError(f"{path}:{child.lineno}: relative import beyond the top")
                    anchor = ".".join(parts[: len(parts) - up])
                    base = f"{anchor}.{base}" if base else anchor
                for alias in child.names:
                    # `from pkg import name`: name may be a submodule, so it counts as pkg.name.
                    target = base if alias.name == "*" else f"{base}.{alias.name}"
                    yield Import(target, child.lineno, lazy)
            yield from visit(child, inner)

    yield from visit(tree, False)


def _under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _service_of(module: str) -> str | None:
    """'placement' for gpuloom.services.placement.*; None outside the services (and for the
    services' package itself, common and the launcher)."""
    if not _under(module, "gpuloom.services") or _under(module, SERVICES_COMMON, LAUNCHER):
        return None
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else None


def _is_grpc(module: str) -> bool:
    top = module.split(".")[0]
    return top == "grpc" or top.startswith("grpc_")


def _is_protobuf(module: str) -> bool:
    return _under(module, "google.protobuf", GENERATED)


def rule_broken(importer: str, imported: Import) -> str | None:
    """The rule an import breaks, or None."""
    target = imported.target
    if _under(importer, "gpuloom.services"):
        if _under(importer, LAUNCHER):
            return None
        if _under(target, "gpuloom.clients"):
            return "a service imports no client"
        if _under(target, SIM):
            return "a service imports no simulator (the CLI and the benchmarks drive them)"
        mine, theirs = _service_of(importer), _service_of(target)
        # services.common (mine is None) counts as below every service.
        if _under(target, LAUNCHER) or (theirs is not None and theirs != mine):
            return "a service imports no other service (talk over gRPC)"
        return None
    if _under(importer, "gpuloom.clients"):
        if _under(target, "gpuloom.services"):
            if importer in LAZY_SERVICE_IMPORTS and imported.lazy:
                return None
            return "a client imports no gpuloom.services (only the serve/up commands, lazily)"
        return None
    # The gpuloom/ folder: below the services and the clients.
    if _under(target, "gpuloom.services", "gpuloom.clients"):
        return "gpuloom/ (domain, convert, policies, shimwire) imports no service or client"
    if _under(importer, "gpuloom.domain"):
        if _under(target, "gpuloom.policies", "gpuloom.convert", SIM):
            return "the domain imports no policy, converter or simulator"
        if _is_grpc(target) or _is_protobuf(target):
            return "the domain imports no gRPC or protobuf"
        if _under(target, "numpy"):
            return "the domain imports no numpy"
    if _under(importer, "gpuloom.convert") and _under(target, "gpuloom.policies", SIM):
        return "a converter imports no policy or simulator"
    if _under(importer, "gpuloom.policies", SIM):
        what = "a policy" if _under(importer, "gpuloom.policies") else "a simulator"
        if _is_grpc(target) or _is_protobuf(target) or _under(target, "asyncio"):
            return f"{what} imports no gRPC, asyncio or protobuf"
        if _under(target, "gpuloom.convert"):
            return f"{what} imports no converter"
        if _under(target, *SOCKETS_AND_THREADS):
            return f"{what} opens no socket and starts no thread or process"
        if _under(target, "ctypes"):
            return f"{what} loads no native library"
        if _under(importer, "gpuloom.policies") and _under(target, SIM):
            return "a policy imports no simulator (the simulators drive the policies)"
    return None


def _allowance(importer: str, target: str) -> tuple[str, str] | None:
    for allowed in ALLOWED:
        if _under(importer, allowed[0]) and _under(target, allowed[1]):
            return allowed
    return None


def violations(
    source: str, module: str, path: str, used: set[tuple[str, str]] | None = None
) -> list[str]:
    """Every import of `source` that breaks a rule, unless ALLOWED (recorded in `used`)."""
    found = []
    for imported in imports_of(source, module, path):
        rule = rule_broken(module, imported)
        if rule is None:
            continue
        allowance = _allowance(module, imported.target)
        if allowance is not None:
            if used is not None:
                used.add(allowance)
            continue
        found.append(f"{path}:{imported.line}: {module} imports {imported.target}: {rule}")
    return found


def test_the_walk_sees_the_real_package_names() -> None:
    modules = package_modules()
    expected = {
        "gpuloom.domain.errors": "gpuloom/domain/errors.py",
        "gpuloom.services.placement.core": "services/placement/core.py",
        "gpuloom.services.launcher": "services/launcher.py",
        "gpuloom.clients.cli.serve": "clients/cli/serve.py",
        "gpuloom.clients.cli": "clients/cli/__init__.py",
        "gpuloom.policies.placement": "gpuloom/policies/placement/__init__.py",
    }
    for name, path in expected.items():
        assert modules[name] == ROOT / path
    assert not any(_under(name, GENERATED) for name in modules)
    assert modules.keys() >= LAZY_SERVICE_IMPORTS


def _check_the_package() -> tuple[list[str], set[tuple[str, str]]]:
    found: list[str] = []
    used: set[tuple[str, str]] = set()
    for module, path in package_modules().items():
        found += violations(path.read_text(), module, str(path.relative_to(ROOT)), used)
    return found, used


def test_no_layer_imports_what_it_must_not() -> None:
    found, _ = _check_the_package()
    assert not found, "imports across the layers:\n" + "\n".join(found)


def test_every_allowance_is_needed() -> None:
    _, used = _check_the_package()
    assert set(ALLOWED) <= used, f"allowed but no longer needed: {set(ALLOWED) - used}"


# The rules for the simulators, numpy in the domain and sockets and threads in the policies
# (test_the_checker_finds_a_forbidden_import takes these cases too).
OUT_OF_PLACE_CASES = [
    (
        "gpuloom.domain.shares",
        "gpuloom/domain/shares.py",
        "import numpy as np\n",
        "the domain imports no numpy",
    ),
    (
        "gpuloom.domain.placement",
        "gpuloom/domain/placement.py",
        "from numpy.typing import NDArray\n",
        "the domain imports no numpy",
    ),
    (
        "gpuloom.domain.training",
        "gpuloom/domain/training.py",
        "from gpuloom.sim.training import simulate\n",
        "the domain imports no policy, converter or simulator",
    ),
    (
        "gpuloom.policies.tokens.scheduler",
        "gpuloom/policies/tokens/scheduler.py",
        "import threading\n",
        "a policy opens no socket and starts no thread or process",
    ),
    (
        "gpuloom.policies.placement.mra",
        "gpuloom/policies/placement/mra.py",
        "from socket import socketpair\n",
        "a policy opens no socket",
    ),
    (
        "gpuloom.policies.mig.far",
        "gpuloom/policies/mig/far.py",
        "def plan():\n    from concurrent.futures import ThreadPoolExecutor\n",
        "a policy opens no socket and starts no thread or process",
    ),
    (
        "gpuloom.policies.training.gandiva",
        "gpuloom/policies/training/gandiva.py",
        "import subprocess\n",
        "starts no thread or process",
    ),
    (
        "gpuloom.policies.fleet.fgd",
        "gpuloom/policies/fleet/fgd.py",
        "from gpuloom.sim import fleet\n",
        "a policy imports no simulator",
    ),
    (
        "gpuloom.policies.profiling.gaps",
        "gpuloom/policies/profiling/gaps.py",
        "import ctypes\n",
        "a policy loads no native library",
    ),
    (
        "gpuloom.sim.fleet",
        "gpuloom/sim/fleet.py",
        "import asyncio\n",
        "a simulator imports no gRPC, asyncio or protobuf",
    ),
    (
        "gpuloom.sim.kernels",
        "gpuloom/sim/kernels.py",
        "from ..convert.placement import spec_to_pb\n",
        "a simulator imports no converter",
    ),
    (
        "gpuloom.sim.training",
        "gpuloom/sim/training.py",
        "import threading\n",
        "a simulator opens no socket and starts no thread or process",
    ),
    (
        "gpuloom.sim.training",
        "gpuloom/sim/training.py",
        "from gpuloom.services.placement.training import TrainingManager\n",
        "imports no service or client",
    ),
    (
        "gpuloom.convert.placement",
        "gpuloom/convert/placement.py",
        "from gpuloom.sim.scenario import Scenario\n",
        "a converter imports no policy or simulator",
    ),
    (
        "gpuloom.services.placement.training",
        "services/placement/training.py",
        "from gpuloom.sim import training\n",
        "a service imports no simulator",
    ),
]


def test_an_allowance_lets_one_import_pass_and_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    source = "import threading\nimport socket\n"
    module, path = "gpuloom.policies.tokens.scheduler", "gpuloom/policies/tokens/scheduler.py"
    allowance = ("gpuloom.policies.tokens", "threading")
    monkeypatch.setitem(ALLOWED, allowance, "an example")
    used: set[tuple[str, str]] = set()
    found = violations(source, module, path, used)
    assert len(found) == 1 and "imports socket" in found[0], found
    assert used == {allowance}


@pytest.mark.parametrize(
    ("module", "path", "source", "broken"),
    [
        (
            "gpuloom.services.placement.core",
            "services/placement/core.py",
            "from gpuloom.services.dispatcher.convert import task_run_from_pb\n",
            "other service",
        ),
        (
            "gpuloom.services.placement.core",
            "services/placement/core.py",
            "from ..profile_store import domain\n",
            "other service",
        ),
        (
            "gpuloom.services.profiler",
            "services/profiler/__init__.py",
            "def f():\n    import gpuloom.services.launcher\n",
            "other service",
        ),
        (
            "gpuloom.services.common.server",
            "services/common/server.py",
            "from ..dispatcher import core\n",
            "other service",
        ),
        (
            "gpuloom.clients.placement",
            "clients/placement.py",
            "def f():\n    from gpuloom.services.common.grpc_errors import rpc\n",
            "a client imports no gpuloom.services",
        ),
        (
            "gpuloom.clients.cli.serve",
            "clients/cli/serve.py",
            "from gpuloom.services import launcher\n",
            "a client imports no gpuloom.services",
        ),
        (
            "gpuloom.domain.profiles",
            "gpuloom/domain/profiles.py",
            "from gpuloom.v1 import profile_store_pb2\n",
            "the domain imports no gRPC or protobuf",
        ),
        (
            "gpuloom.domain.gpus",
            "gpuloom/domain/gpus.py",
            "from ..policies.mig import plan\n",
            "the domain imports no policy",
        ),
        (
            "gpuloom.domain.mig_runs",
            "gpuloom/domain/mig_runs.py",
            "import gpuloom.services.profile_store.core\n",
            "imports no service or client",
        ),
        (
            "gpuloom.policies.tokens.scheduler",
            "gpuloom/policies/tokens/scheduler.py",
            "import asyncio\n",
            "a policy imports no gRPC, asyncio or protobuf",
        ),
        (
            "gpuloom.policies.placement.binpack",
            "gpuloom/policies/placement/binpack.py",
            "def f():\n    from gpuloom.clients.placement import PlacementClient\n",
            "imports no service or client",
        ),
        *OUT_OF_PLACE_CASES,
    ],
)
def test_the_checker_finds_a_forbidden_import(
    module: str, path: str, source: str, broken: str
) -> None:
    found = violations(source, module, path)
    assert len(found) == 1 and broken in found[0], found
    assert found[0].startswith(f"{path}:"), found


@pytest.mark.parametrize(
    ("module", "path", "source"),
    [
        ("gpuloom.services.launcher", "services/launcher.py", "from .placement import app\n"),
        (
            "gpuloom.clients.cli.serve",
            "clients/cli/serve.py",
            "def f():\n    from gpuloom.services import launcher\n",
        ),
        (
            "gpuloom.services.placement.core",
            "services/placement/core.py",
            "from . import metrics\nfrom ..common import errors\nfrom gpuloom.domain import gpus\n"
            "from gpuloom.convert.mig import task_run_from_pb\nimport grpc\n",
        ),
        (
            "gpuloom.domain.gpus",
            "gpuloom/domain/gpus.py",
            "from .mig_geometry import get_geometry\n",
        ),
        (
            "gpuloom.policies.mig.far",
            "gpuloom/policies/mig/far.py",
            "from gpuloom.domain import errors\nimport numpy as np\n",
        ),
        (
            "gpuloom.sim.fleet",
            "gpuloom/sim/fleet.py",
            "import numpy as np\nimport time\nfrom gpuloom.policies.fleet import model\n",
        ),
        (
            "gpuloom.clients.cli.sim",
            "clients/cli/sim.py",
            "from gpuloom.sim.kernels import simulate\n",
        ),
    ],
)
def test_the_checker_lets_allowed_imports_pass(module: str, path: str, source: str) -> None:
    assert violations(source, module, path) == []
