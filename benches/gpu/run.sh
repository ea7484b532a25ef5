#!/usr/bin/env bash
# Runs the extraction benchmark modes of one case, each in its own process, one after the other
# (so they share the machine's state), plus the disk's bandwidth.
#
# usage: benches/gpu/run.sh CASE RESULTS_DIR [MODE...]
#   CASE: 1b (Llama-3.2-1B arch, layers 2,8,13, 3000 x 256), 8b (Llama-3.1-8B arch, layers
#   2,16,29,32, 1500 x 1024) or smoke (1b arch, 64 x 256). MODEs: see bench_extract.py.
# SCRATCH (default /var/tmp/layertap-bench) must be on the disk being measured. A variant:
# BENCH_EXTRA='{"writer_threads": 12}' BENCH_TAG=t12 (more connector options, and its label).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
case_=$1; results=$2; shift 2
modes=("$@"); [ ${#modes[@]} -gt 0 ] || modes=(none upstream layertap-python layertap-rust-none layertap-rust-bp16 layertap-rust-none-direct
  layertap-rust-bp16-direct)
case $case_ in
  1b) model=llama-3.2-1b-arch layers=2,8,13 prompts=3000 len=256 ;;
  8b) model=llama-3.1-8b-arch layers=2,16,29,32 prompts=1500 len=1024 ;;
  smoke) model=llama-3.2-1b-arch layers=2,8,13 prompts=64 len=256 ;;
  *) echo "unknown case $case_" >&2; exit 2 ;;
esac
scratch=${SCRATCH:-/var/tmp/layertap-bench}
mkdir -p "$results" "$scratch"
for m in "${modes[@]}"; do
  name=$case_-$m${BENCH_TAG:+-$BENCH_TAG}
  echo "== $name $(date -u +%T)"
  python3 "$here/bench_extract.py" --mode "$m" --model "$here/models/$model" --layers "$layers" \
    --prompts "$prompts" --len "$len" --out "$scratch/out" --result "$results/$name.json" \
    --extra "${BENCH_EXTRA:-{\}}" --tag "${BENCH_TAG:-}" > "$results/$name.log" 2>&1
  echo "rc=$? $(tail -n 1 "$results/$name.log" | cut -c1-400)"
  rm -rf "$scratch/out"
done
