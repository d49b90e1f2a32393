#!/usr/bin/env python3
"""Folds `perf script -F comm,pid,tid,ip,sym` (dwarf call graphs) of a lat_small run: the
initiator's samples inside an entry point (default postXfer), by leaf and by the first
frame of ours above the leaf.   perf-fold.py FILE [ENTRY]"""
import collections
import re
import sys

path, entry = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "postXfer")
samples = open(path, errors="replace").read().split("\n\n")


def thread(head):
    w = head.split()
    return w[1] if len(w) > 1 else "?"


def frames(lines):
    out = []
    for l in lines:
        parts = l.strip().split(None, 1)
        out.append(re.sub(r"\(.*", "", parts[1] if len(parts) > 1 else "?")[:110])
    return out


threads = collections.Counter(thread(s.strip().split("\n")[0]) for s in samples if s.strip())
print("samples per thread:", threads.most_common(4))
main = sorted(t for t, _ in threads.most_common(2))[0]  # the forked target has the higher pid
inside, leaf, ours = 0, collections.Counter(), collections.Counter()
total = 0
for s in samples:
    lines = s.strip().split("\n")
    if not lines or thread(lines[0]) != main:
        continue
    total += 1
    fr = frames(lines[1:])
    if not any(entry in f for f in fr):
        continue
    inside += 1
    leaf[fr[0]] += 1
    mine = next((f for f in fr if "nixl_fabric::" in f or "nf::" in f), "?")
    ours[mine] += 1
print(f"initiator {main}: {total} samples, {inside} inside {entry}")
print("-- leaves"); [print(f"{v:6d} {k}") for k, v in leaf.most_common(30)]
print("-- innermost frame of ours"); [print(f"{v:6d} {k}") for k, v in ours.most_common(30)]
