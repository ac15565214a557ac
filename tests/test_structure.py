"""The house as a contract: the layering (import-linter, pyproject's [tool.importlinter]) and the
one crossing it ignores, module and function sizes, no reach into another module's private names,
and ruff's lint and format (pyproject's [tool.ruff]). Each check reads the source only: it runs in
a second and needs no cluster."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests.helpers import ROOT, parse_source

PACKAGES = ("engine_ext", "eepctl")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, ast.Module]:
    """Every first-party module's syntax tree, by its path relative to the repository."""
    return {
        str(p.relative_to(ROOT)): parse_source(p.read_text(), str(p))
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
    }


def test_import_contracts_hold():
    """Layers (CLI > drivers > hosts > controller | rank > model > mechanisms > records), the
    model imported only by the rank side, no torch on the controller side, no import circle."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is not installed (it is in the test extra)"
    res = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout and "BROKEN" not in res.stdout, res.stdout[-2000:]


RANK_ACTOR_CROSSINGS = {"engine_ext.rank.engine", "engine_ext.rank.standby"}


def test_the_rank_actor_imports_the_rank_side_only_inside_functions():
    """The torch contract ignores exactly the rank actor's two imports of the rank side: they run
    in the rank's own process, inside the actor's constructor. Moved to module level, either would
    load the engine and torch wherever the class is defined (the controller, the drivers, eepctl),
    and the contract, told to ignore it, would not say so."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: import-linter's own TOML reader
        import tomli as tomllib
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    ignored = {i for c in contracts if "torch" in c.get("forbidden_modules", []) for i in c.get("ignore_imports", [])}
    assert ignored == {f"engine_ext.ray.rank_actor -> {m}" for m in sorted(RANK_ACTOR_CROSSINGS)}, ignored
    tree = parse_source((ROOT / "engine_ext" / "ray" / "rank_actor.py").read_text())
    in_functions = {
        id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)
    }
    rank_side: list[tuple[ast.stmt, str]] = []
    for node in ast.walk(tree):
        names = (
            [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        rank_side += [(node, m) for m in names if m == "engine_ext.rank" or m.startswith("engine_ext.rank.")]
    outside = [f"line {n.lineno}: {m}" for n, m in rank_side if id(n) not in in_functions]
    assert not outside, f"rank_actor.py imports the rank side outside a function: {outside}"
    assert {m for _, m in rank_side} == RANK_ACTOR_CROSSINGS, sorted(m for _, m in rank_side)


def test_modules_and_functions_are_short():
    """A reader sees a module's one concept and a function whole."""
    too_long: list[str] = []
    for path, tree in _modules().items():
        lines = len((ROOT / path).read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, "\n".join(too_long)


def _is_stub(node: ast.AST) -> bool:
    """A declaration that defines nothing: ``name: T`` without a value, or a function whose body
    is ``...`` (a docstring aside). A mixin that declares its host's private attributes this way
    still uses them: the host's module defines them."""
    if isinstance(node, ast.AnnAssign):
        return node.value is None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = [
            b
            for b in node.body
            if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str))
        ]
        return len(body) == 1 and isinstance(body[0], ast.Expr) and getattr(body[0].value, "value", None) is ...
    return False


def _private_definitions(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, module globals, and attributes it
    assigns on ``self``/``cls``; a stub (``_is_stub``) defines nothing."""
    names: set[str] = set()
    declared = {id(n.target) for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) and _is_stub(n)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not _is_stub(node):
                names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and id(node) not in declared:
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and id(node) not in declared
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _foreign_private_uses(path: str, tree: ast.Module, owners: dict[str, set[str]]) -> list[str]:
    """``obj._name`` or ``from first_party import _name``, where ``_name`` is a private name
    another first-party module defines and this one does not. ``self._name`` counts too: a class
    that uses a private name only its subclass or base in another module defines (a mixin) is
    coupled to that module's insides."""
    mine = _private_definitions(tree)
    foreign = {
        (a.asname or a.name).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for a in n.names
        if a.name.split(".")[0] not in PACKAGES
    }
    foreign |= {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] not in PACKAGES
        for a in n.names
    }
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
            found += [
                f"{path}:{node.lineno} imports {node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in foreign:
                continue  # a third-party module's internals
            if node.attr not in mine and owners.get(node.attr, set()) - {path}:
                found.append(f"{path}:{node.lineno} uses {node.attr} of {sorted(owners[node.attr])}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    """Interfaces are written down: no first-party module uses a private name that only another
    first-party module defines (vLLM's, Ray's and torch's internals are the plugin catalogue's and
    the transport's business, not this check's)."""
    trees = _modules()
    owners: dict[str, set[str]] = defaultdict(set)
    for path, tree in trees.items():
        for name in _private_definitions(tree):
            owners[name].add(path)
    found = [use for path, tree in trees.items() for use in _foreign_private_uses(path, tree, owners)]
    assert not found, "\n".join(found)


def test_the_private_name_check_sees_a_mixins_reach_into_its_host():
    """A mixin that declares its host's private attributes as stubs still uses them: the check
    reports each use (a stub defines nothing), and none once the host is reached through public
    names (a collaborator with an interface, as engine_ext.ray.vllm_loop's ``LoopHost``)."""
    mixin = ast.parse(
        "class Loop:\n    _changed: object\n    def _call(self, m): ...\n"
        "    def tick(self):\n        with self._changed:\n            return self._call('x')\n"
    )
    host = ast.parse(
        "class Controller(Loop):\n    def __init__(self):\n        self._changed = 1\n"
        "    def _call(self, m):\n        return m\n    def call(self, m):\n        return m\n"
    )
    collaborator = ast.parse(
        "class Loop:\n    def __init__(self, host):\n        self.host = host\n"
        "    def tick(self):\n        return self.host.call('x')\n"
    )
    owners: dict[str, set[str]] = defaultdict(set)
    for path, tree in (("mixin.py", mixin), ("host.py", host)):
        for name in _private_definitions(tree):
            owners[name].add(path)
    assert _private_definitions(mixin) == set()  # stubs only: it defines nothing
    found = _foreign_private_uses("mixin.py", mixin, owners)
    assert sorted(u.split(" uses ")[1].split(" ")[0] for u in found) == ["_call", "_changed"], found
    assert _foreign_private_uses("collaborator.py", collaborator, owners) == []


def test_the_cli_core_never_asks_which_engine_it_drives():
    """eepctl.core (every module of the package) talks to every deployment through the driver seam
    (engine_ext.drivers): no "is it vLLM" branch, no import of an engine's driver module."""
    modules = sorted((ROOT / "eepctl" / "core").glob("*.py"))
    assert len(modules) > 1 and (ROOT / "eepctl" / "core" / "__init__.py") in modules, modules
    for path in modules:
        source = path.read_text()
        tree = ast.parse(source)
        imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not [m for m in imported if "vllm" in m], (path.name, sorted(imported))
        assert "vllm" not in source.lower(), (path.name, [ln for ln in source.splitlines() if "vllm" in ln.lower()])


def _ruff(*args: str) -> subprocess.CompletedProcess:
    """ruff (pinned in the test extra) run over the repository with pyproject's [tool.ruff]; no cache
    written into the tree."""
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert exe, "ruff is not installed (it is in the test extra)"
    pinned = re.search(r'"ruff==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout.split()[-1]
    assert pinned and version == pinned[1], f"ruff {version} is not the test extra's {pinned and pinned[1]}"
    return subprocess.run([exe, *args, "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_finds_nothing():
    """The lint rules pyproject's [tool.ruff] selects hold over the whole tree: pycodestyle (lines of
    at most 120 characters), pyflakes, bugbear and the import order."""
    res = _ruff("check", "--output-format", "concise")
    assert res.returncode == 0, (
        f"`ruff check .` finds (`ruff check --fix <files>` fixes some):\n{res.stdout[-6000:]}{res.stderr[-2000:]}"
    )


def test_the_tree_is_formatted_by_ruff():
    """Every file is as `ruff format` (line length 120) writes it."""
    res = _ruff("format", "--check", "--output-format", "concise")
    assert res.returncode == 0, (
        f"`ruff format --check .` would change (`ruff format <files>` does):\n{res.stdout[-6000:]}{res.stderr[-2000:]}"
    )


def test_the_lanes_split_ray_and_vllm_as_conftest_says():
    """Two lanes (scripts/test.sh's two workers, tests/conftest.py): every module that starts a vLLM server is
    in the vLLM unit (their servers share vLLM's default ports and the session's oracle), which runs
    on lane 0; lane 1 starts Ray only in the modules ``WAITING_RAY`` names; every other module that
    starts Ray runs on lane 0."""
    from tests.conftest import VLLM_SERVER_MODULES, WAITING_RAY, _lane, _work_unit

    ray_starts = ("ray_cluster", "deployments", "pytest.mark.ray", "start_local", "import ray")
    vllm_starts = ("vllm_oracle", "vllm_checkpoint", "vllm_servers")
    modules = {
        p.stem: p.read_text() for p in sorted((ROOT / "tests").glob("test_*.py")) if p.name != Path(__file__).name
    }  # this one names them
    lanes = {m: _lane(_work_unit(m)) for m in modules}
    serves_vllm = sorted(m for m, text in modules.items() if any(s in text for s in vllm_starts))
    assert serves_vllm and all(m in VLLM_SERVER_MODULES and lanes[m] == 0 for m in serves_vllm), serves_vllm
    ray_in_lane_1 = sorted(m for m, text in modules.items() if lanes[m] == 1 and any(s in text for s in ray_starts))
    assert ray_in_lane_1 == sorted(WAITING_RAY), ray_in_lane_1
    assert sum(1 for v in lanes.values() if v == 1) > 20 and sum(1 for v in lanes.values() if v == 0) > 10, lanes
