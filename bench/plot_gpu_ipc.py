#!/usr/bin/env python3
"""Plots the same-host GPU results of tests/gpu/agent_ipc.py (run on the GPU host by
`bash .gpu/run-gpu.sh`, JSON brought back under bench/results/) and merges them into one
JSON file next to the plot.

    plot_gpu_ipc.py OUT_PREFIX LABEL=OURS.json:UCX.json [LABEL=OURS.json:UCX.json ...]

writes OUT_PREFIX.json (every run, with ratios per case) and OUT_PREFIX.png (one panel per
LABEL: GB/s per case, ours next to UCX, log scale).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(p):
    with open(p) as f:
        return json.load(f)


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    prefix, panels = argv[1], []
    for spec in argv[2:]:
        label, pair = spec.split("=", 1)
        ours_p, ucx_p = pair.split(":", 1)
        ours, ucx = load(ours_p), load(ucx_p)
        u = {r["key"]: r for r in ucx["results"]}
        rows = []
        for r in ours["results"]:
            o, x = r.get("gbps"), (u.get(r["key"]) or {}).get("gbps")
            rows.append({"case": r["name"], "ours_gbps": o, "ucx_gbps": x,
                         "ratio": round(o / x, 2) if o and x else None,
                         "ours_exact": r["verified"], "ucx_exact": (u.get(r["key"]) or {}).get("verified")})
        panels.append({"label": label, "ours": ours_p, "ucx": ucx_p, "baselines": ours.get("baselines", {}),
                       "one_process": ours.get("one_process", False), "rows": rows})
    with open(prefix + ".json", "w") as f:
        json.dump({"panels": panels}, f, indent=1)
        f.write("\n")
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 4.5 * len(panels)), squeeze=False)
    for ax, p in zip(axes[:, 0], panels):
        names = [r["case"] for r in p["rows"]]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [r["ours_gbps"] or 0 for r in p["rows"]], 0.4, label="nixl-fabric")
        ax.bar([x + 0.2 for x in xs], [r["ucx_gbps"] or 0 for r in p["rows"]], 0.4, label="stock UCX")
        ax.set_yscale("log")
        ax.set_ylabel("GB/s")
        ax.set_title(p["label"])
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
        dtod = p["baselines"].get("dtod_64MiB")
        if dtod:
            ax.axhline(dtod, color="gray", ls="--", lw=0.8, label=f"bare cuMemcpyDtoD 64 MiB ({dtod:.0f})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(prefix + ".png", dpi=110)
    print(f"{prefix}.json, {prefix}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
