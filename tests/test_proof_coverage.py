"""The proofs cover what they claim: every broken variant in engine_ext.faults has a test that shows
its harm, and every test the docs name exists. Torch-free, no Ray: pytest's own collection of the
modules that name the mark is asked, in a subprocess, which tests carry ``@pytest.mark.harm``."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from engine_ext.faults import VARIANTS
from tests.helpers import ROOT, parse_source

THIS = Path(__file__).name

# Entries of VARIANTS that break nothing, so there is no harm to show (each says why).
NOT_BROKEN = {"slow_prepare": "a hold on joining ranks in prepare: a window to kill a joiner, not a broken mechanism"}

_COLLECT = """
import json, sys
import pytest

class Harms:
    def __init__(self):
        self.by_variant = {}

    def pytest_collection_finish(self, session):
        for item in session.items:
            for mark in item.iter_markers("harm"):
                for variant in mark.args:
                    self.by_variant.setdefault(variant, []).append(item.nodeid)

harms = Harms()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[harms])
print("HARMS " + json.dumps({"exit": int(code), "by_variant": harms.by_variant}))
"""


def _harm_tests() -> dict[str, list[str]]:
    """variant -> node ids of the collected tests marked ``harm(variant)``: pytest's own collection
    (parametrized cases included), so a name in a comment or a test that is not collected counts for nothing."""
    # only the modules that name the mark are collected (the whole suite took 65 s of a loaded CI box)
    modules = sorted((ROOT / "tests").glob("test_*.py"))
    marking = [str(p.relative_to(ROOT)) for p in modules if p.name != THIS and "mark.harm" in p.read_text()]
    cmd = [sys.executable, "-c", _COLLECT, *marking]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("HARMS ")), None)
    assert line is not None, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    got = json.loads(line[len("HARMS ") :])
    assert got["exit"] == 0, f"collecting the modules that mark harm failed (exit {got['exit']}): {out.stdout[-2000:]}"
    return got["by_variant"]


def test_every_fault_variant_has_a_test_that_shows_its_harm():
    harms = _harm_tests()
    assert set(NOT_BROKEN) <= set(VARIANTS), "an exemption names no variant"
    unknown = sorted(set(harms) - set(VARIANTS))
    assert not unknown, f"harm marks name no variant of engine_ext.faults.VARIANTS: {unknown}"
    missing = sorted(set(VARIANTS) - set(NOT_BROKEN) - set(harms))
    assert not missing, f"fault variants with no test marked @pytest.mark.harm(<variant>): {missing}"
    assert not set(NOT_BROKEN) & set(harms), "an exempted variant has a harm test: drop the exemption"


def _defined_test_names() -> set[str]:
    """The test modules and every function defined in tests/ (read from the syntax tree)."""
    names: set[str] = set()
    for path in (ROOT / "tests").glob("*.py"):
        names.add(path.stem)
        names.update(
            n.name
            for n in ast.walk(parse_source(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        )
    return names


def test_every_test_the_docs_name_exists():
    """A renamed or merged test leaves no doc pointing at nothing. A name followed by ``*`` is a
    glob (some module must match it); one followed by a data suffix names a results file."""
    defined = _defined_test_names()
    stale = []
    for doc in sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]):
        text = doc.read_text()
        for m in re.finditer(r"\btest_\w+", text):
            name, after = m.group(0), text[m.end() : m.end() + 5]
            if after.startswith("*"):
                ok = any(d.startswith(name) for d in defined)
            elif re.match(r"\.(log|json|csv|txt|svg)\b", after):
                continue
            else:
                ok = name in defined
            if not ok:
                stale.append(f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {name}")
    assert not stale, "docs name tests that do not exist:\n" + "\n".join(stale)
