#!/usr/bin/env bash
# Runs the extraction benchmark modes of one case, each in its own process, one after the other
# (so they share the machine's state), plus the disk's bandwidth.
#
# usage: benches/gpu/run.sh CASE RESULTS_DIR [MODE...]
#   CASE: 1b (Llama-3.2-1B arch, layers 2,8,13, 3000 x 256), short (1b arch, 20000 prompts of
#   16 to 128 tokens), decode (1b arch, 2000 x (128 prompt + 128 generated), records with the
#   output tokens), 8b (Llama-3.1-8B arch, layers 2,16,29,32, 1500 x 1024), qwen7b (Qwen2.5-7B
#   arch, layers 2,14,25,28, 400 x 2048: its dummy activations compress ~1.5x, like a trained
#   model's) or smoke (1b arch, 64 x 256). MODEs: see bench_extract.py (layertap-inmodel and
#   noop-inmodel: capture in the model, without vLLM's speculative method).
# SCRATCH (default /var/tmp/layertap-bench) must be on the disk being measured. A variant:
# BENCH_EXTRA='{"writer_threads": 12}' BENCH_TAG=t12 (more connector options, and its label).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
case_=$1; results=$2; shift 2
modes=("$@"); [ ${#modes[@]} -gt 0 ] || modes=(none noop upstream layertap-python layertap-rust-none layertap-rust-bp16 layertap-rust-none-direct
  layertap-rust-bp16-direct)
minlen=0 maxtok=1 outputs=()
case $case_ in
  1b) model=llama-3.2-1b-arch layers=2,8,13 prompts=3000 len=256 ;;
  short) model=llama-3.2-1b-arch layers=2,8,13 prompts=20000 len=128 minlen=16 ;;
  decode) model=llama-3.2-1b-arch layers=2,8,13 prompts=2000 len=128 maxtok=128 outputs=(--include-output-tokens) ;;
  qwen7b) model=qwen2.5-7b-arch layers=2,14,25,28 prompts=400 len=2048 ;;
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
    --prompts "$prompts" --len "$len" --min-len "$minlen" --max-tokens "$maxtok" "${outputs[@]}" --case "$case_" --out "$scratch/out" --result "$results/$name.json" \
    --extra "${BENCH_EXTRA:-{\}}" --tag "${BENCH_TAG:-}" > "$results/$name.log" 2>&1
  echo "rc=$? $(tail -n 1 "$results/$name.log" | cut -c1-400)"
  # Which CUDA graphs the engine captured (vLLM's method holds it to PIECEWISE).
  echo "graphs: $(grep -ao 'Capturing CUDA graphs ([^)]*)' "$results/$name.log" | sort -u | tr '\n' ' ')"
  rm -rf "$scratch/out"
done
