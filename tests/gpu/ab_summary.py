#!/usr/bin/env python3
"""Summarises staged (between-hosts) runs of agent_ipc.py: each run's VRAM cases against the same
pattern DRAM->DRAM over the same rails in the same run, the lowest ratio per run, the mean per
arm, and UCX where a UCX run of the same call is given.

    ab_summary.py [--title T] [--ucx staging_ucx.json] ARM:ROUND=staging.json[+dram_kv.json] ...

A run's DRAM rates come from its own JSON (the 64 MiB row) and the dram_kv JSON named after '+'
(the KV patterns). Arms are grouped by the name before ':'; rounds keep their order.
"""
import argparse
import json
import statistics as st

CASES = [f"{op}|{a}|{b}|{p}" for op in ("READ", "WRITE") for a, b, p in (
    ("VRAM", "VRAM", "1x64MiB"), ("VRAM", "DRAM", "1x64MiB"), ("DRAM", "VRAM", "1x64MiB"),
    ("VRAM", "VRAM", "1024x16KiB"), ("VRAM", "VRAM", "4096x4KiB"), ("VRAM", "VRAM", "256x256KiB"))]


def dram_of(case):
    op, _, _, pat = case.split("|")
    return f"{op}|DRAM|DRAM|{pat}"


def rates(path):
    return {r["key"]: r["gbps"] for r in json.load(open(path))["results"] if r.get("gbps") and r.get("verified", True)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--title", default="")
    ap.add_argument("--ucx", help="agent_ipc.py --backend UCX results of the same call")
    ap.add_argument("runs", nargs="+")
    o = ap.parse_args()
    runs = []
    for spec in o.runs:
        name, files = spec.split("=", 1)
        arm = name.split(":")[0]
        res = {}
        for f in files.split("+"):
            res.update(rates(f))
        runs.append((name, arm, res))
    cases = [c for c in CASES if any(c in r for _, _, r in runs)]
    head = " | ".join(c.replace("|", " ") for c in cases)
    if o.title:
        print(o.title)
    print("GB/s (x the same pattern DRAM->DRAM over the same rails, same run)")
    print(f"run | {head}")

    def cell(res, c):
        if c not in res:
            return "-"
        d = res.get(dram_of(c))
        return f"{res[c]:5.2f} ({res[c] / d:.2f})" if d else f"{res[c]:5.2f}"

    for name, _, res in runs:
        print(f"{name} | " + " | ".join(cell(res, c) for c in cases))
    low = []
    for name, _, res in runs:
        rs = [res[c] / res[dram_of(c)] for c in cases if c in res and dram_of(c) in res]
        under = sum(1 for x in rs if x < 0.8)
        low.append(f"{name} {min(rs):.2f} ({under} of {len(rs)} under 0.8)" if rs else f"{name} -")
    print("lowest ratio per run: " + ", ".join(low))
    by_arm = {}
    for _, arm, res in runs:
        by_arm.setdefault(arm, []).append(res)
    drams = sorted({dram_of(c) for c in cases})
    print(f"mean GB/s | {head} | " + " | ".join(d.replace("|", " ") for d in drams))
    for a, rs in by_arm.items():
        print(f"{a} | " + " | ".join(
            f"{st.mean(r[c] for r in rs if c in r):.2f}" if any(c in r for r in rs) else "-" for c in cases + drams))
    print(f"mean ratio to DRAM (mean over mean) | {head}")
    for a, rs in by_arm.items():
        out = []
        for c in cases:
            both = [r for r in rs if c in r and dram_of(c) in r]
            out.append(f"{st.mean(r[c] for r in both) / st.mean(r[dram_of(c)] for r in both):.2f}" if both else "-")
        print(f"{a} | " + " | ".join(out))
    if o.ucx:
        u = rates(o.ucx)
        print(f"UCX tcp+cuda_copy GB/s, same call | {head}")
        print("ucx | " + " | ".join(f"{u[c]:.2f}" if c in u else "-" for c in cases))
        for a, rs in by_arm.items():
            out = []
            for c in cases:
                v = [r[c] / u[c] for r in rs if c in r and c in u]
                out.append(f"{min(v):.0f}-{max(v):.0f}x" if v else "-")
            print(f"{a} x UCX (each run) | " + " | ".join(out))


if __name__ == "__main__":
    main()
