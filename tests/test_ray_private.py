"""Ray's private API is used in one module (engine_ext/ray/ray_private.py), and that module's
every private call still exists in the installed Ray as it is called: a Ray upgrade that moves or
changes one fails here, by name, instead of in a deployment. No cluster: it reads the installed
package and the source."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

from engine_ext.ray.ray_private import CATALOGUE
from tests.helpers import ROOT, parse_source

OWNER = "engine_ext/ray/ray_private.py"
SCANNED = ("engine_ext", "eepctl", "benchmarks", "tests", "scripts")


def _resolve(module: str, path: str) -> object:
    obj: object = importlib.import_module(module)
    for part in path.split("."):
        obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
    return obj


@pytest.mark.parametrize(("module", "path", "params"), CATALOGUE, ids=[f"{m}.{p}" for m, p, _ in CATALOGUE])
def test_each_private_call_exists_as_it_is_called(module: str, path: str, params: tuple[str, ...]) -> None:
    obj = _resolve(module, path)
    if isinstance(obj, property):  # an attribute read off an instance (ActorHandle._actor_id)
        assert obj.fget is not None and not params
        return
    assert callable(obj), f"{module}.{path} is no longer callable"
    signature = inspect.signature(obj)
    missing = [p for p in params if p not in signature.parameters]
    assert not missing, f"{module}.{path}{signature} no longer takes {missing}"


def _private_uses(tree: ast.AST) -> list[str]:
    """Imports of ``ray._*`` modules and uses of Ray's private names this module's owner holds."""
    names = {p.split(".")[-1] for _, p, _ in CATALOGUE if p.split(".")[-1].startswith("_")}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray":
            private = [p for p in (node.module or "").split(".")[1:] if p.startswith("_")]
            if private or any(a.name.startswith("_") for a in node.names):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {a.name}"
                for a in node.names
                if a.name.startswith("ray.") and any(p.startswith("_") for p in a.name.split(".")[1:])
            ]
        elif isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_no_other_module_uses_rays_private_api() -> None:
    found = []
    for top in SCANNED:
        for p in sorted((ROOT / top).rglob("*.py")):
            rel = str(p.relative_to(ROOT))
            if rel == OWNER or rel == "tests/test_ray_private.py":
                continue
            found += [f"{rel} {use}" for use in _private_uses(parse_source(p.read_text(), rel))]
    assert not found, "Ray's private API outside " + OWNER + ":\n" + "\n".join(found)


def test_the_scan_sees_each_kind_of_private_use() -> None:
    """The scan itself: an import from a private module, a private attribute, a private name."""
    source = (
        "from ray._private.state import state\nfrom ray import _raylet\nh._actor_id.hex()\n"
        "from ray.experimental import internal_kv\ninternal_kv._internal_kv_get(b'k')\n"
    )
    assert len(_private_uses(ast.parse(source))) == 4
