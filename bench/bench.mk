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
BENCH_ARGS    ?=
BENCH_TIMEOUT ?= 1200

.PHONY: bench

# matplotlib is needed only for the PNG, so it is installed here and not by `venv` (the test
# venv's requirements stay as they are). Without it the run still writes the JSON.
$(VENV)/.matplotlib.ok: $(VENV)/.ok
	@if $(PY) -c 'import matplotlib' 2>/dev/null || $(VENV)/bin/pip install -q matplotlib; then \
	  touch $@; else echo "bench: matplotlib could not be installed; no PNG this run"; fi

bench: build venv $(VENV)/.matplotlib.ok
	PY=$(PY) timeout -k 10 $(BENCH_TIMEOUT) bash $(ROOT)/bench/run.sh $(BENCH_ARGS)
