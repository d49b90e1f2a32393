#!/usr/bin/env python3
"""Collates the packed-staging runs of 2026-12-05 (H100 host, 16 cores; two processes through
the stock agent nixl-cu13 1.5.1, tcp on lo, same-host paths off, agent_ipc.py --quick) into
summary.json and staging.png beside this file. call5-ab.tar.xz is the A/B of the commit that
moved staged chunks off rail 0: old4 = 803c229 with 4 rails, new4 / new5 = 220ba39 with 4 / 5
rails (5 is the new automatic count on 16 cores), each twice, interleaved, with the same
patterns DRAM->DRAM over the same rails right after each. UCX (tcp,cuda_copy,self) is from
call1 on the same kind of host (H100, an earlier call: not the same run).
"""
import json, os, statistics, sys, tarfile, io
HERE = os.path.dirname(os.path.abspath(__file__))
PATTERNS = ["1x64MiB", "1024x16KiB", "256x256KiB", "4096x4KiB"]

def rows(fileobj):
    d = json.load(fileobj)
    return {(r["op"], r["local"], r["remote"], r["pattern"]): (r.get("gbps") or 0.0, r["verified"]) for r in d["results"]}

def load_tar(name):
    out = {}
    with tarfile.open(os.path.join(HERE, name)) as t:
        for m in t.getmembers():
            b = os.path.basename(m.name)
            if b.endswith(".json"):
                out[b] = rows(io.TextIOWrapper(t.extractfile(m)))
    return out

ab = load_tar("call5-ab.tar.xz")
ucx = rows(open(os.path.join(HERE, "call1", "ucx_tcp.json")))
summary = {"host": "H100 host (16 cores), device calls of 2026-12-05 19:05-19:26 UTC", "unit": "GB/s, median of the reps",
           "configs": {}, "ucx_tcp_cuda_copy_call1": {}}
allexact = True
for cfg in ("old4", "new4", "new5"):
    c = {}
    for op in ("WRITE", "READ"):
        for p in PATTERNS:
            v = [ab[f"staging_c0-d4-{cfg}-{rep}.json"][(op, "VRAM", "VRAM", p)] for rep in (1, 2)]
            dr = [ab[f"dram-{cfg}-{rep}.json"][(op, "DRAM", "DRAM", p)] for rep in (1, 2)]
            allexact &= all(x[1] for x in v + dr)
            vm, dm = statistics.median(x[0] for x in v), statistics.median(x[0] for x in dr)
            ratios = [a[0] / b[0] for a, b in zip(v, dr) if b[0]]
            c[f"{op} {p}"] = {"vram": [x[0] for x in v], "dram": [x[0] for x in dr], "vram_median": round(vm, 2),
                              "dram_median": round(dm, 2), "vram_over_dram_per_rep": [round(r, 2) for r in ratios],
                              "vram_over_ucx": round(vm / ucx[(op, "VRAM", "VRAM", p)][0], 1)}
    summary["configs"][cfg] = c
for op in ("WRITE", "READ"):
    for p in PATTERNS:
        summary["ucx_tcp_cuda_copy_call1"][f"{op} {p}"] = ucx[(op, "VRAM", "VRAM", p)][0]
summary["every_byte_checked_and_exact"] = allexact
json.dump(summary, open(os.path.join(HERE, "summary.json"), "w"), indent=1)
for cfg, c in summary["configs"].items():
    print(cfg)
    for k, v in c.items():
        print(f"  {k:<18} VRAM {v['vram']} DRAM {v['dram']} VRAM/DRAM {v['vram_over_dram_per_rep']} x UCX {v['vram_over_ucx']}")
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("no matplotlib: summary.json only")
keys = list(summary["configs"]["new5"].keys())
fig, ax = plt.subplots(figsize=(12, 5))
w = 0.2
for i, cfg in enumerate(("old4", "new4", "new5")):
    ax.bar([k + (i - 1.5) * w for k in range(len(keys))], [summary["configs"][cfg][k]["vram_median"] for k in keys], w, label=f"VRAM {cfg}")
ax.bar([k + 1.5 * w for k in range(len(keys))], [summary["configs"]["new5"][k]["dram_median"] for k in keys], w, label="DRAM, 5 rails (new5)", color="grey")
ax.plot(range(len(keys)), [summary["ucx_tcp_cuda_copy_call1"][k] for k in keys], "k^", label="UCX tcp+cuda_copy VRAM")
ax.set_xticks(range(len(keys)))
ax.set_xticklabels(keys, rotation=20, fontsize=8)
ax.set_ylabel("GB/s (median of 2)")
ax.set_title("Packed staging over tcp, two processes, H100 host, 2026-12-05 (old4 = 803c229, new = 220ba39)")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(HERE, "staging.png"), dpi=100)
