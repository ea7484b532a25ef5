#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, once .devbundle/unpack.sh has unpacked vLLM
# 0.26 into /tmp/site (benches/gpu/README.md says how). Installs the carried wheels, then:
#   bash benches/gpu/device.sh CASES [MODE[+VARIANT...]...]
#                                 extraction benchmark (run.sh: CASES such as 1b or 1b,short,decode
#                                 on one engine per mode) + disk + tables
#   bash benches/gpu/device.sh writer                  writer benchmark against dd
#   bash benches/gpu/device.sh codecs                  nvCOMP's codecs on real activations (issue 21)
#   bash benches/gpu/device.sh exphuf                  exp-huf in torch on the GPU (issue 21)
#   bash benches/gpu/device.sh kernels                 issue 32's Triton kernels (encoder, decoder)
#   bash benches/gpu/device.sh decoder                 issue 32's decoder: mode-2 kernels, the Dataset
#   bash benches/gpu/device.sh dataset-ab              the Dataset's device path, .devbundle/old against this tree
#   bash benches/gpu/device.sh host                    the codecs and the CPU Dataset on the host's cores, no vLLM
#   bash benches/gpu/device.sh generate 1b|8b          layertap generate against the bare connector
#   bash benches/gpu/device.sh check-inmodel [ARCH...] capture in the model against transformers,
#                                                      CUDA graphs and eager (default: Llama, Gemma 2)
#   bash benches/gpu/device.sh check-method [--layers=...] ARCH...   the same with vLLM's method
# Results accumulate in /tmp/layertap-results (kept while the machine stays warm) and are packed
# into $OUT/results.tgz after every call.
set -uo pipefail
# BENCH_WHEELS and BENCH_SITE: other folders for a dry run of this script on the CPU machine.
wheels=${BENCH_WHEELS:-.devbundle/wheels} site=${BENCH_SITE:-/tmp/site}
if compgen -G "$wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl || exit 1
fi
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
# The build before a change (run.sh's "+old" variant), in a folder of its own put first on
# PYTHONPATH for those modes only.
export BENCH_OLD_SITE=${BENCH_OLD_SITE:-/tmp/site-old}
if compgen -G "${BENCH_WHEELS_OLD:-.devbundle/wheels-old}/*.whl" > /dev/null; then
  rm -rf "$BENCH_OLD_SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$BENCH_OLD_SITE" "${BENCH_WHEELS_OLD:-.devbundle/wheels-old}"/*.whl || exit 1
fi
# FlashInfer would JIT-compile its sampler for minutes; a forked engine hung at start-up there.
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
export SCRATCH=${SCRATCH:-/var/tmp/layertap-bench}
results=${BENCH_RESULTS:-/tmp/layertap-results}
mkdir -p "$results"
what=$1; shift
case $what in
  generate)
    case ${1:-1b} in
      1b) gen_args=(--model benches/gpu/models/llama-3.2-1b-arch --layers 2,8,13 --prompts 3000 --len 256) ;;
      8b) gen_args=(--model benches/gpu/models/llama-3.1-8b-arch --layers 2,16,29,32 --prompts 1500 --len 1024) ;;
    esac
    python3 benches/bench_generate.py "${gen_args[@]}" --rounds 2 --scratch "$SCRATCH/generate" \
      --out "$results/generate-${1:-1b}" 2>&1 | tail -n 20 ;;
  check-inmodel)
    [ $# -gt 0 ] || set -- LlamaForCausalLM Gemma2ForCausalLM
    log=$results/check-inmodel.log
    python3 tests/vllm/gpu_check_plugin.py "$SCRATCH/check-inmodel" --in-model "$@" > "$log" 2>&1
    grep -a -e '^{' -e PLUGIN-GPU-CHECK -e 'Error' "$log" | cut -c1-600
    # Full graphs of decode steps are captured unless something held the engine to PIECEWISE.
    echo "graphs: $(grep -ao 'Capturing CUDA graphs ([^)]*)' "$log" | sort | uniq -c | tr '\n' ' ')"
    grep -a 'setting cudagraph_mode' "$log" | cut -c1-300 | sort -u ;;
  check-method)
    # The plugin's families with capture="method" (vLLM's speculative method), CUDA graphs and
    # eager, against transformers: `device.sh check-method [--layers=4,1,2] ARCH...` (issue 36).
    log=$results/check-method-$(date +%s).log
    python3 -c "import transformers; print('transformers', transformers.__version__)"
    python3 tests/vllm/gpu_check_plugin.py "$SCRATCH/check-method" "$@" > "$log" 2>&1
    grep -a -e '^{' -e PLUGIN-GPU-CHECK -e 'Error' "$log" | cut -c1-600 ;;
  codecs)
    # GPU compression candidates (issue 21): nvCOMP from its wheels, carried apart (34 MB).
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      .devbundle/wheels-nvcomp/*.whl || exit 1
    python3 benches/gpu/bench_gpu_codecs.py --activations .devbundle/acts/activations-2k.safetensors \
      --out "$results/gpu-codecs" 2>&1 | tail -n 60 ;;
  exphuf)
    # exp-huf in torch on the GPU (issue 21): bytes against the Rust encoder's, ratio, GB/s, host CPU.
    python3 benches/gpu/bench_gpu_exphuf.py --activations .devbundle/acts/activations-2k.safetensors \
      --out "$results/gpu-exphuf" 2>&1 | tail -n 20 ;;
  kernels)
    # issue 32's Triton kernels, no vLLM: the tree's python/ first, with the carried extension
    # (stripped, .devbundle/kern: the wheel of the commit measured is not built for a kernel call).
    cp .devbundle/kern/_native.abi3.so python/layertap/ || exit 1
    export PYTHONPATH=$PWD/python:$PYTHONPATH
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    for check in tests/triton_kernels/check_*.py; do
      timeout 150 python3 "$check" --device cuda 2>&1 | tail -n 5 | sed "s|^|$(basename "$check"): |"
    done
    timeout 200 python3 benches/gpu/bench_gpu_exphuf.py --activations .devbundle/acts/activations-2k.safetensors \
      --out "$results/gpu-exphuf-kernels" 2>&1 | tail -n 30
    timeout 150 python3 benches/gpu/bench_gpu_exphuf_decode.py --activations .devbundle/acts/activations-2k.safetensors \
      --out "$results/gpu-exphuf-decode" 2>&1 | tail -n 30 ;;
  decoder)
    # issue 32, goal 3, no vLLM: the decoder's checks compiled (both block modes), its GB/s on
    # the device by column (the Rust writer's records) and by element, and a trainer's read loop
    # against raw safetensors. Each step's output goes to $results as it runs (kept if one times out).
    cp .devbundle/kern/_native.abi3.so python/layertap/ || exit 1
    export PYTHONPATH=$PWD/python:$PYTHONPATH
    mkdir -p "$SCRATCH"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    timeout 120 python3 tests/triton_kernels/check_exphuf_decoder.py --device cuda > "$results/check-decoder.log" 2>&1
    grep -a -e FAIL -e 'cases ok' "$results/check-decoder.log" | cut -c1-300
    timeout 60 python3 tests/triton_kernels/check_torch_gpu_decode.py --device cuda all > "$results/check-torch-decode.log" 2>&1
    grep -a -e '^ok' -e FAIL "$results/check-torch-decode.log" | cut -c1-200
    timeout 150 python3 benches/gpu/bench_gpu_exphuf_decode.py --activations .devbundle/acts/activations-2k.safetensors \
      --batches 256x64 2048x16 256x256 2048x64 --variants columns columns-32 columns-256 default \
      --budget-s 100 --out "$results/gpu-exphuf-decode-columns" > "$results/gpu-exphuf-decode-columns.log" 2>&1
    tail -n 20 "$results/gpu-exphuf-decode-columns.log"
    timeout 100 python3 benches/gpu/bench_gpu_exphuf_decode.py --synthetic --shape 4x4096 --modes column \
      --batches 256x64 2048x16 --variants columns columns-256 \
      --out "$results/gpu-exphuf-decode-8b" > "$results/gpu-exphuf-decode-8b.log" 2>&1
    tail -n 8 "$results/gpu-exphuf-decode-8b.log"
    timeout 120 python3 benches/gpu/bench_gpu_dataset_decode.py --synthetic --shape 4x4096 --tokens 256 \
      --records 256 --batch 64 --dir "$SCRATCH" --out "$results/gpu-dataset-decode" > "$results/gpu-dataset-decode.log" 2>&1
    tail -n 10 "$results/gpu-dataset-decode.log" ;;
  dataset-ab)
    # The Dataset's device path before and after a change to its host side, no vLLM: the
    # decoder's checks on CUDA with this tree, then bench_gpu_dataset_decode.py on the three shapes
    # of benches/RESULTS.md's tables (--reps 5), the tree before the change (.devbundle/old/python:
    # `git archive` of its python/ with its stripped extension inside) and this one in turns.
    cp .devbundle/kern/_native.abi3.so python/layertap/ || exit 1
    new=$PWD/python old=$PWD/.devbundle/old/python
    [ -f "$old/layertap/_native.abi3.so" ] || { echo "no .devbundle/old/python/layertap/_native.abi3.so" >&2; exit 1; }
    if [ "${AB_CHECKS:-1}" != 0 ]; then  # AB_CHECKS=0: the benchmark alone
      PYTHONPATH=$new:$PYTHONPATH timeout 150 python3 tests/triton_kernels/check_exphuf_decoder.py --device cuda > "$results/check-decoder.log" 2>&1
      grep -a -e FAIL -e 'cases ok' "$results/check-decoder.log" | cut -c1-200 | tail -5
      PYTHONPATH=$new:$PYTHONPATH timeout 100 python3 tests/triton_kernels/check_torch_gpu_decode.py --device cuda all > "$results/check-torch-decode.log" 2>&1
      grep -a -e '^ok' -e FAIL "$results/check-torch-decode.log" | cut -c1-160
    fi
    ab() {  # tag, variant, bench arguments...
      local tag=$1 v=$2 py=$new; shift 2
      [ "$v" = old ] && py=$old
      mkdir -p "$SCRATCH/$tag"
      PYTHONPATH=$py:$PYTHONPATH timeout 150 python3 benches/gpu/bench_gpu_dataset_decode.py "$@" --reps 5 \
        --dir "$SCRATCH/$tag" --out "$results/dataset-$tag-$v" > "$results/dataset-$tag-$v.log" 2>&1
      echo "$tag $v: $(grep -a -e 'on device' -e 'safetensors |' "$results/dataset-$tag-$v.md" | tr -s ' ' | tr '\n' ' ')"
    }
    # AB_SHAPES: which of the shapes to run (all three by default), each old, new, old, new.
    for tag in ${AB_SHAPES:-minilm s256 s2048}; do
      for v in old new old new; do
        case $tag in
          minilm) ab minilm $v --activations .devbundle/acts/activations-2k.safetensors --tokens 256 --records 512 --batch 64 ;;
          s256) ab s256 $v --synthetic --shape 4x4096 --tokens 256 --records 256 --batch 64 ;;
          s2048) ab s2048 $v --synthetic --shape 4x4096 --tokens 2048 --records 64 --batch 16 ;;
        esac
      done
    done ;;
  host)
    # No vLLM, no GPU: the codecs through the writer and reader on 1 and all of the host's cores
    # (is exp-huf's writer ahead of bp16-zstd's there too?), then the torch Dataset with its
    # default threads, 0 and 4 workers. BENCH_WHEELS holds layertap's wheel and the cp312 wheels
    # of crc32c, zstandard and inotify_simple (no bundle brings zstandard here).
    a=.devbundle/acts/activations-2k.safetensors
    lscpu | grep -E 'Model name|^CPU\(s\)'
    timeout 200 python3 benches/bench_codecs.py --out "$results/codecs-host" --tokens 2048 --passes 8 --levels 1 \
      --dtypes bf16 --activations "$a" > "$results/codecs-host.log" 2>&1
    tail -n 9 "$results/codecs-host.md"
    timeout 250 python3 benches/bench_torch_dataset.py --dir "$SCRATCH/dataset" --out "$results/torch-dataset-host" \
      --activations "$a" --workers 0 4 --rounds 2 > "$results/torch-dataset-host.log" 2>&1
    grep -a '^| [04] |' "$results/torch-dataset-host.md" ;;
  writer)
    python3 benches/bench_writer.py --dir "$SCRATCH/writer" --total 4GiB --threads 8 \
      --activations .devbundle/acts/activations.safetensors --out "$results/writer-h200" ;;
  *)
    [ -f "$results/disk.json" ] || [ -n "${SKIP_DISK:-}" ] || bash benches/gpu/disk.sh "$results" 4
    bash benches/gpu/run.sh "$what" "$results" "$@"
    python3 benches/gpu/report.py "$results" > "$results/table.md"
    cat "$results/table.md" ;;
esac
[ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" -C "$results" .
exit 0
