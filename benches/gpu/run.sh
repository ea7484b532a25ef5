#!/usr/bin/env bash
# Runs the extraction benchmark's modes one after the other, each in its own process (so they
# share the machine's state), each running the given cases on one engine.
#
# usage: benches/gpu/run.sh CASES RESULTS_DIR [MODE...]
#   CASES: one case or several separated by commas, which then run in that order on one engine
#   (they must share the architecture): 1b (Llama-3.2-1B arch, layers 2,8,13, 3000 x 256),
#   short (the same arch, 20000 prompts of 16 to 128 tokens), decode (the same arch, 2000 x
#   (128 prompt + 128 generated), records with the output tokens), 8b (Llama-3.1-8B arch, layers
#   2,16,29,32, 1500 x 1024), qwen7b (Qwen2.5-7B arch, layers 2,14,25,28, 400 x 2048: its dummy
#   activations compress ~1.5x, like a trained model's) or smoke (1b arch, 64 x 256); see
#   CASES in bench_extract.py. MODEs: see bench_extract.py.
# SCRATCH (default /var/tmp/layertap-bench) must be on the disk being measured.
# A MODE may carry variants after "+", each also part of the results' label (the tag):
#   +t<N>   writer_threads N (compression threads)
#   +old    the layertap installed under $BENCH_OLD_SITE (device.sh: the wheel carried in
#           .devbundle/wheels-old), first on PYTHONPATH: the build before a change, alternated
#           with the current one in one call
#   +aff    (an experiment) the writer's threads pinned to CPUs of their own (whole cores from
#           the top, as many as compression threads, at most half), the engine's on the others
#   +raw    codec "none": the writer frames and writes without compressing (is it compression's
#           CPU work that slows the engine thread?)
#   +exphuf codec "exp-huf", compressed by the writer's threads on the host
#   +gpu    compress_on="gpu": exp-huf encoded on the GPU before the copy (issue 21)
#   +prof   py-spy the engine core over each case's window, native stacks (BENCH_PROFILE
#           sets the kind: native or python)
#   +load<N> N busy processes (a Python loop each) beside the engine for the mode's run: does
#           load alone on the host's other cores slow the engine thread as the writer's does?
#   +<word> a label only (a second round: +r2)
# e.g. run.sh 1b,short,decode R none+prof layertap-rust-bp16+prof layertap-rust-bp16+t4
# BENCH_EXTRA (a JSON object of more connector options) and BENCH_TAG apply to every mode;
# BENCH_ARGS adds bench_extract.py arguments (a CPU dry run's --model, --scale, --cpu-kv-bytes).
# After each mode, when $OUT is set (a device call), the results so far are packed into
# $OUT/results.tgz, so a call cut short keeps every mode it finished.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cases=$1; results=$2; shift 2
modes=("$@"); [ ${#modes[@]} -gt 0 ] || modes=(none noop upstream layertap-rust-none layertap-rust-bp16 layertap-rust-none-direct
  layertap-rust-bp16-direct)
scratch=${SCRATCH:-/var/tmp/layertap-bench}
mkdir -p "$results" "$scratch"
for spec in "${modes[@]}"; do
  IFS=+ read -r -a parts <<< "$spec"
  m=${parts[0]} extra=${BENCH_EXTRA:-{\}} profile=off pypath=${PYTHONPATH:-} tag=${BENCH_TAG:-} pin=0 load=0
  for v in "${parts[@]:1}"; do
    case $v in
      t[0-9]*) extra=$(python3 -c "import json,sys; d=json.loads(sys.argv[1]); d['writer_threads']=int(sys.argv[2]); print(json.dumps(d))" "$extra" "${v#t}") ;;
      old) [ -d "${BENCH_OLD_SITE:-}" ] || { echo "$spec: +old needs BENCH_OLD_SITE (a folder holding the old layertap)"; continue 2; }
           pypath=$BENCH_OLD_SITE${pypath:+:$pypath} ;;
      prof) profile=${BENCH_PROFILE:-native} ;;
      raw) extra=$(python3 -c "import json,sys; d=json.loads(sys.argv[1]); d['codec']='none'; print(json.dumps(d))" "$extra") ;;
      exphuf) extra=$(python3 -c "import json,sys; d=json.loads(sys.argv[1]); d['codec']='exp-huf'; print(json.dumps(d))" "$extra") ;;
      gpu) extra=$(python3 -c "import json,sys; d=json.loads(sys.argv[1]); d.update(codec='exp-huf', compress_on='gpu'); print(json.dumps(d))" "$extra") ;;
      load[0-9]*) load=${v#load} ;;
      aff) pin=$(python3 -c "import json,os,sys; print(json.loads(sys.argv[1]).get('writer_threads') or max(4, min(16, len(os.sched_getaffinity(0)) // 2)))" "$extra") ;;
    esac
    tag=${tag:+$tag-}$v
  done
  name=${cases//,/+}-$m${tag:+-$tag}
  echo "== $name $(date -u +%T)"
  busy=()
  for _ in $(seq 1 "$load"); do python3 -c 'while True: pass' & busy+=($!); done
  # shellcheck disable=SC2086
  PYTHONPATH=$pypath python3 "$here/bench_extract.py" --mode "$m" --cases "$cases" --results "$results" --out "$scratch/out" \
    --extra "$extra" --tag "$tag" --profile "$profile" --pin-writer "$pin" ${BENCH_ARGS:-} > "$results/$name.log" 2>&1
  echo "rc=$? $(grep -a -e '^[a-z0-9]*: [0-9,]* tok/s' "$results/$name.log" | tr '\n' ' ' | cut -c1-400)"
  [ ${#busy[@]} -eq 0 ] || kill "${busy[@]}"
  grep -a -e 'Error' -e 'Traceback' "$results/$name.log" | grep -v 'skip_tokenizer_init' | tail -n 3 | cut -c1-300
  # Which CUDA graphs the engine captured (vLLM's method holds it to PIECEWISE).
  echo "graphs: $(grep -ao 'Capturing CUDA graphs ([^)]*)' "$results/$name.log" | sort -u | tr '\n' ' ')"
  rm -rf "$scratch/out"
  [ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" -C "$results" .
done
exit 0
