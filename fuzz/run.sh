#!/usr/bin/env bash
# Runs each cargo-fuzz target for FUZZ_RUNS iterations from the seed corpus and prints, per
# target, the iterations executed and the crashes found. Called by `make fuzz`
# (plugin_tests/reliability.mk); usable alone from the repository root:
#   FUZZ_RUNS=1000000 bash fuzz/run.sh [target ...]
# Environment: FUZZ_RUNS (100000), FUZZ_MAX_S (per-target wall bound, 600), FUZZ_MAX_LEN
# (8192), FUZZ_LOGDIR (build/fuzz), CARGO (cargo).
# The seeds are tests/corpus/<target>/ (read only); what libFuzzer adds goes to
# fuzz/corpus/<target>/ (ignored by git); crash inputs to fuzz/artifacts/<target>/.
set -uo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
RUNS=${FUZZ_RUNS:-100000}
MAX_S=${FUZZ_MAX_S:-600}
MAX_LEN=${FUZZ_MAX_LEN:-8192}
LOGDIR=${FUZZ_LOGDIR:-build/fuzz}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(conn_info mem_desc ctrl)
mkdir -p "$LOGDIR"
export RUSTC_BOOTSTRAP=1 # cargo-fuzz needs nightly flags (-Zsanitizer, sancov); stable allows them so

if ! $CARGO fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz (cargo install cargo-fuzz)"
  $CARGO install cargo-fuzz || { echo "fuzz: cargo-fuzz could not be installed"; exit 2; }
fi
echo "fuzz: building the targets ($($CARGO fuzz --version))"
timeout 1200 $CARGO fuzz build >"$LOGDIR/build.log" 2>&1 || { tail -30 "$LOGDIR/build.log"; echo "fuzz: build failed"; exit 2; }

total_crash=0
summary=()
for t in "${targets[@]}"; do
  seeds=tests/corpus/$t
  work=fuzz/corpus/$t
  arts=fuzz/artifacts/$t
  mkdir -p "$work" "$arts"
  before=$(ls "$arts" | wc -l)
  log=$LOGDIR/$t.log
  t0=$(date +%s%N)
  # -runs bounds the iterations, -max_total_time and timeout(1) the wall time.
  timeout $((MAX_S + 60)) $CARGO fuzz run "$t" "$work" "$seeds" -- \
    -runs="$RUNS" -max_len="$MAX_LEN" -max_total_time="$MAX_S" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 >"$log" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  iters=$(sed -n 's/^stat::number_executed_units: *//p' "$log" | tail -1)
  [ -n "$iters" ] || iters=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$log" | tail -1)
  [ -n "$iters" ] || iters=$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#') # last progress line
  new=$(( $(ls "$arts" | wc -l) - before ))
  crashes=$new
  [ $rc -ne 0 ] && [ $crashes -eq 0 ] && crashes=1 # died without writing an artifact
  total_crash=$((total_crash + crashes))
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
  line=$(printf "fuzz %-9s: %s iterations, %d crashes (exit %d, %d.%03d s, %s, corpus %d seeds + %d found)" \
    "$t" "${iters:-?}" "$crashes" "$rc" $((ms / 1000)) $((ms % 1000)) "${cov:-cov: ?}" "$(ls "$seeds" | wc -l)" "$(ls "$work" | wc -l)")
  echo "$line"
  summary+=("$line")
  if [ $crashes -gt 0 ]; then
    grep -E "panicked at|ERROR: |SUMMARY|Test unit written" "$log" | head -8 | sed 's/^/    /'
    ls -t "$arts" | head -3 | sed "s|^|    artifact: $arts/|"
  fi
done
echo "---- fuzz summary (logs in $LOGDIR)"
printf '%s\n' "${summary[@]}"
echo "fuzz: $total_crash crashes in total"
[ $total_crash -eq 0 ]
