"""Per scale that loaded experts in its commit: each rank's bytes, load time, threads, and the rest
of its commit's reshuffle part (run15/run16 printed this; usage: python commit_loads.py CURVES.json ...)."""

import json
import sys

for p in sys.argv[1:]:
    r = json.load(open(p))
    print(p)
    for x in r["bytes"]:
        rp = x["reshuffle_parts_by_rank"]
        for k, v in sorted(rp.items()):
            if v.get("commit_copy_bytes"):
                cp = x["commit_parts_by_rank"][k]
                print(
                    "  %4.0f pause %.4f r%s load %3d MiB %.4f s thr %s reshuffle %.4f other %.4f"
                    % (
                        x["expert_MiB"],
                        x["pause_s"],
                        k,
                        v["commit_copy_bytes"] >> 20,
                        v["load_s"],
                        v.get("load_threads"),
                        cp["reshuffle"],
                        cp["reshuffle"] - v["load_s"],
                    )
                )
