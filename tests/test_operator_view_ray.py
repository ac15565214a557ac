"""The operator's view on a live deployment: `eepctl scale` in a real terminal (a pty) draws the
live display and leaves its final picture; status carries capture timings and the EPLB balance;
`events --timeline` draws the operation, `events` lists it under its short id; status reads through
the light path and agrees with the Ray driver path; a recreated registry says it is rebuilding
rather than showing a short list."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from typing import Any

import pytest

from engine_ext.ray.ray_private import actor_id
from tests.helpers import NAMESPACE, ROOT, eepctl, eepctl_json, up_cli, wait_for

pytestmark = pytest.mark.ray
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


def run_in_pty(args: list[str], timeout: float = 240) -> tuple[int, str]:
    """Run the real CLI with a terminal as stdout and stderr; return its exit code and everything
    it drew, escape sequences removed."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    env.update(TERM="xterm-256color", COLUMNS="120", LINES="40")
    proc = subprocess.Popen(
        [sys.executable, "-m", "eepctl", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        cwd=ROOT,
        close_fds=True,
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        rc = proc.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        os.close(master)
    return rc, _ANSI.sub("", b"".join(chunks).decode(errors="replace"))


@pytest.mark.timeout(600)
def test_scale_on_a_terminal_then_status_timeline_and_registry_restart(deployments: Any, ray_cluster: Any) -> None:
    d = deployments("opview")
    up_cli(d, 2, 3)
    eepctl("generate", "--name", d.name, "-o", "json", timeout=120)  # some expert load

    rc, screen = run_in_pty(["scale", "--dp", "3", "--name", d.name])
    assert rc == 0, screen[-3000:]
    print(f"\n[opview] the terminal after `eepctl scale` (last 2500 chars):\n{screen[-2500:]}")
    final = screen[screen.rfind("ranks done") :]  # the last frame the live display left, and the summary
    for phase in ("launch", "prepare", "commit", "warm", "capture", "cleanup"):
        assert phase in final, (phase, final)
    assert "ranks done" in screen and "slowest rank" in screen and "3/3" in final
    assert "DP 2 -> 3  running" in screen  # the op record's sizes while it ran
    assert final.index("│ commit") < final.index("│   warm") < final.index("│   capture")  # nested in commit
    assert re.search(r"serving pause: \d+\.\d ms", final), final
    assert "succeeded" in screen and "waiting for the first phase" not in final
    op_id = re.search(r"(op-[\w-]+): DP 2 -> 3 succeeded", screen).group(1)

    snap = eepctl_json("status", "--name", d.name)
    for r in snap["ranks"]:
        assert r["graph_kind"] == "cpu-static" and r["capture_sizes"], r
        assert set(r["capture_times_s"]) == {str(s) for s in r["capture_sizes"]}, r["capture_times_s"]
        assert r["last_capture_pass_s"] == pytest.approx(sum(r["capture_times_s"].values()), abs=1e-5)
        assert len(r["eplb_slots"]) == 8 and len(r["eplb_recent_load"]) == 8
    text = eepctl("status", "--name", d.name).stdout
    assert "cpu-static 4 sizes" in text and "eplb imbalance (max/mean rank load, recent window):" in text

    tl = eepctl_json("events", "--op", op_id, "--timeline", "--name", d.name)
    assert tl["object"] == "timeline" and {s["rank"] for s in tl["spans"]} == {-1, 0, 1, 2}
    assert tl["pause"]["duration_s"] > 0 and tl["slowest_rank"] in (0, 1, 2)
    drawn = eepctl("events", "--op", op_id, "--timeline", "--name", d.name).stdout
    assert "serving pause" in drawn and "<- slowest" in drawn and "controller" in drawn
    # the plan's predicted cost beside what the scale measured (engine_ext/control/cost_model.py)
    listed = eepctl("events", "--op", op_id, "--name", d.name).stdout
    assert f"{op_id} predicted vs measured: pause" in listed and "moved per rank" in listed, listed
    _events_by_short_id_and_a_scale_left_running(d.name, op_id)

    light = eepctl_json("status", "--name", d.name)
    res = eepctl("status", "--name", d.name, "-o", "json", env={"EEPCTL_READ_PATH": "ray"})
    via_ray = __import__("json").loads(res.stdout.splitlines()[-1])
    assert [r["instance_id"] for r in light["ranks"]] == [r["instance_id"] for r in via_ray["ranks"]]

    import ray
    from eepctl import cluster
    from eepctl.readpath import events as readpath_events
    from eepctl.readpath import reader
    from engine_ext.ray.names import registry_name

    assert reader(ray_cluster["address"], NAMESPACE, d.name) is not None, "the registry published no endpoint"
    # `events` reads the same endpoint (GET /events), and answers what the Ray driver path answers
    light_ev = readpath_events(ray_cluster["address"], NAMESPACE, d.name, op_id)
    assert light_ev is not None, "the registry serves no events over the light path"
    res = eepctl("events", "--op", op_id, "--name", d.name, "-o", "json", env={"EEPCTL_READ_PATH": "ray"})
    via_ray_ev = __import__("json").loads(res.stdout.splitlines()[-1])
    assert [e["seq"] for e in light_ev["events"]] == [e["seq"] for e in via_ray_ev["events"]] != []
    assert [o["op_id"] for o in light_ev["operations"]] == [o["op_id"] for o in via_ray_ev["operations"]] == [op_id]
    cluster.connect(ray_cluster["address"], NAMESPACE)
    old = ray.get_actor(registry_name(d.name), namespace=NAMESPACE)
    old_id = actor_id(old)
    ray.kill(old, no_restart=True)

    def new_registry() -> Any:
        try:
            h = ray.get_actor(registry_name(d.name), namespace=NAMESPACE)
        except ValueError:
            return None
        return h if actor_id(h) != old_id else None

    reg = wait_for(new_registry, timeout=30, interval=0.05, what="the registry recreated")
    seen_short = 0
    deadline = time.time() + 15
    while time.time() < deadline:
        s = ray.get(reg.snapshot.remote())
        if len(s["ranks"]) < 3:  # never an unexplained short list
            seen_short += 1
            assert s["rebuilding"] is True and s["expected_ranks"] == 3, s
        else:
            assert s["rebuilding"] is False
            break
        time.sleep(0.05)
    assert len(s["ranks"]) == 3
    print(f"\n[opview] rebuilding snapshots seen before the ranks re-sent: {seen_short}")


def _events_by_short_id_and_a_scale_left_running(name: str, op_id: str) -> None:
    """`events`: one line per operation under its short id, no rank events without -v; `--op`
    takes the short id; `--timeline` without `--op` draws the last operation; `scale --no-wait`
    prints a follow-up command that works as pasted."""
    import shlex

    short = op_id.rsplit("-", 1)[1]
    table = eepctl("events", "--name", name).stdout
    row = next(ln for ln in table.splitlines() if ln.startswith("│ " + short))
    assert "│ scale " in row and "│ 2->3 " in row and "│ succeeded " in row, table
    assert "rank 0     prepare" not in table and "rank 0     prepare" in eepctl("events", "-v", "--name", name).stdout
    assert eepctl_json("events", "--op", short, "--name", name)["operations"][0]["op_id"] == op_id
    assert eepctl_json("events", "--timeline", "--name", name)["op_id"] == op_id
    left = eepctl("scale", "--dp", "2", "--no-wait", "--name", name)
    assert left.returncode == 0, left.stderr
    follow = left.stdout.split("follow it with: ", 1)[1].strip()
    assert f"--name {name}" in follow, follow
    args = shlex.split(follow)
    assert args[0] == "eepctl"
    done = eepctl(*args[1:], timeout=240)
    assert done.returncode == 0 and "DP 3 -> 2 succeeded" in done.stdout, (done.stdout, done.stderr)
    assert eepctl("scale", "--dp", "3", "--name", name).returncode == 0  # back to the size the test goes on with
