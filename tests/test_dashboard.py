"""The shipped Grafana dashboard (docs/grafana/eepctl-autoscaler.json): valid JSON, exactly the
panels docs/autoscaling.md names, and every metric it queries is one engine_ext/ray/metrics.py
exports and docs/operations.md documents."""

from __future__ import annotations

import json
import re

from tests.helpers import ROOT


def test_the_dashboard_loads_with_the_documented_panels_and_real_metrics() -> None:
    dash = json.loads((ROOT / "docs" / "grafana" / "eepctl-autoscaler.json").read_text())
    docs = (ROOT / "docs" / "autoscaling.md").read_text()
    section = docs.split("## Metrics and the Grafana dashboard", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^- \*\*(.+?)\*\*$", section, flags=re.MULTILINE)
    assert [p["title"] for p in dash["panels"]] == documented
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    exported = (ROOT / "engine_ext" / "ray" / "metrics.py").read_text()
    ops = (ROOT / "docs" / "operations.md").read_text()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert "$deployment" in t["expr"], t["expr"]
            for name in re.findall(r"ray_(eep_[a-z0-9_]+)", t["expr"]):
                assert f'"{name}"' in exported, f"{panel['title']}: {name} is not a metric engine_ext exports"
                assert name in ops, f"{name} is not in docs/operations.md"
