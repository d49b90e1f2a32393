# make bench: nixl-fabric (provider tcp, provider shm, and tcp with its default same-host shm
# rail) next to stock UCX and the wheel's stock LIBFABRIC plugin, all through the stock NIXL
# agent (nixl-cu12, Python API) in two processes on this machine, plus memcpy and raw loopback
# TCP baselines. A benchmark, not a test: prints a table and writes
# bench/results/<YYYY-MM-DD>.json and .png. Fails only if a backend returned wrong bytes or one
# of our configurations could not run. Included by the top-level Makefile.
#   make bench                                      full run (a few minutes on 2 cores)
#   make bench BENCH_ARGS=--quick                   smoke run, few iterations
#   make bench BENCH_ARGS='--configs ours-tcp,ucx'  a subset
#   make bench BENCH_ARGS='--quick --configs dram'  the GPU host's DRAM set: ours tcp with rails
#       1/2/4/8, default and one-process against UCX tcp-only, default and one-process, raw TCP
#       over 1/2/4/8 streams (ratio table). On the GPU host: RUN_GPU_ONLY=dram bash .gpu/run-gpu.sh
# Logs of every process: build/bench/<config>.log (probe: <config>.probe.log).
# `make bench` also runs bench-descs (issue #23, descriptor-heavy requests, bench/descs.py):
#   make bench-descs                                 make_prepped_xfer create ns/descriptor,
#       post, first post of a fresh handle vs reposts, GB/s, for 1024-65536 x 4 KiB, shuffled and
#       adjacent, WRITE and READ, one process and two, progress thread on and off, ours vs UCX
#       (~8-10 min on 2 cores); bench/results/descs-<date>.json/.png, logs in build/bench/descs
#   make bench-descs DESCS_ARGS=--quick              smoke (~5 s: one process, 1024/4096)
#   make bench-vllm-dram                             bench/vllm_kv.py over numpy DRAM (the GPU
#       script's own code path on this machine: 8 layers x 512 blocks, requests 16/64/256);
#       the real run is the GPU bundle's: RUN_GPU_ONLY=vllm bash .gpu/run-gpu.sh
#   make bench-notif                                 small transfers over tcp (issue #23,
#       bench/notif_netns.sh -> notif_latency.py): 4/64 KiB WRITE until the target sees its
#       notification, WRITE and READ until DONE; ours, UCX tcp and the stock LIBFABRIC plugin,
#       each with progress threads and without; in a network namespace of its own (root);
#       bench/results/notif-<date>.json (~2 min). For a comparison on a machine whose speed
#       drifts: NOTIF_ARGS="--iters 10000 --rounds 6" (configurations alternate per round)
#   make bench-smoke                                 both quick, results under build/bench/smoke
BENCH_ARGS    ?=
BENCH_TIMEOUT ?= 1200
# `make bench BENCH_ARGS=--quick` makes the descriptor benchmark quick too
DESCS_ARGS    ?= $(if $(findstring --quick,$(BENCH_ARGS)),--quick,)
DESCS_TIMEOUT ?= 1200
VLLM_ARGS     ?=
# Loopback only, as bench/run.sh (every child of the scripts sets it again)
BENCH_ENV     := FI_TCP_IFACE=lo FI_SOCKETS_IFACE=lo NIXL_FABRIC_IFACE=lo UCX_NET_DEVICES=lo UCX_MODULES='^ib'

.PHONY: bench bench-descs bench-vllm-dram bench-notif bench-smoke

# matplotlib is needed only for the PNG, so it is installed here and not by `venv` (the test
# venv's requirements stay as they are). Without it the run still writes the JSON.
$(VENV)/.matplotlib.ok: $(VENV)/.ok
	@if $(PY) -c 'import matplotlib' 2>/dev/null || $(VENV)/bin/pip install -q matplotlib; then \
	  touch $@; else echo "bench: matplotlib could not be installed; no PNG this run"; fi

bench: build venv $(VENV)/.matplotlib.ok
	PY=$(PY) timeout -k 10 $(BENCH_TIMEOUT) bash $(ROOT)/bench/run.sh $(BENCH_ARGS)
	$(MAKE) --no-print-directory bench-descs DESCS_ARGS='$(DESCS_ARGS)'

bench-descs: build venv $(VENV)/.matplotlib.ok
	$(BENCH_ENV) timeout -k 10 $(DESCS_TIMEOUT) $(PY) $(ROOT)/bench/descs.py $(DESCS_ARGS)

bench-vllm-dram: build venv $(VENV)/.matplotlib.ok
	$(BENCH_ENV) timeout -k 10 900 $(PY) $(ROOT)/bench/vllm_kv.py --mem dram $(VLLM_ARGS)

NOTIF_ARGS ?= --iters 1000
bench-notif: build venv
	@mkdir -p $(BUILD)/bench/notif
	PY=$(PY) timeout -k 10 900 bash $(ROOT)/bench/notif_netns.sh --plugin-dir $(PLUGINS) $(NOTIF_ARGS) \
	  --logs $(BUILD)/bench/notif --out $(ROOT)/bench/results/notif-$$(date +%F).json

# CI smoke of both scripts (about a minute on 2 cores); not part of `make test`
bench-smoke: build venv
	$(BENCH_ENV) timeout -k 10 120 $(PY) $(ROOT)/bench/descs.py --quick --out $(BUILD)/bench/smoke
	$(BENCH_ENV) timeout -k 10 300 $(PY) $(ROOT)/bench/vllm_kv.py --mem dram --quick --requests 16,64 \
	  --out $(BUILD)/bench/smoke
