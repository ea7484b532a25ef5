#!/usr/bin/env bash
# Here (the CPU machine), before a GPU session: fills .devbundle/ (ignored by git) with
#  - vLLM 0.26 in four parts (../shared/device/build-vllm-bundle.sh), unless already there;
#  - wheels/: layertap's abi3 wheel and the crc32c wheel for CPython 3.12 (the GPU image has
#    the other dependencies, zstandard comes with the vLLM bundle);
#  - wheels/ also holds py-spy (the engine core's sampling profile, run.sh's "+prof");
#  - wheels/ also holds inotify_simple and loguru (pure Python; the installs are --no-deps);
#  - wheels-old/: with OLD_COMMIT=<commit>, layertap's wheel built at that commit (run.sh's
#    "+old": the build before a change, alternated with the current one in one device call);
#  - wheels-nvcomp/: nvCOMP's wheels and lz4 (device.sh codecs, issue 21);
#  - acts/activations.safetensors: 8192 tokens of real bf16 activations for the writer benchmark
#    (activations-2k: 2048 of them, for the codecs call, which carries nvCOMP too: 4096 went over the
#    64 MiB a call carries).
# Then follow benches/gpu/README.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.devbundle/' .git/info/exclude 2>/dev/null || echo '/.devbundle/' >> .git/info/exclude
[ -f .devbundle/parts ] || bash ../shared/device/build-vllm-bundle.sh .devbundle
# A call carries at most 64 MiB with the tracked tree (21.7 MiB on 2026-12-06, when the bundle's
# 45 MiB parts stopped fitting): cut the parts again to what is left, minus 4 MiB of margin.
# unpack.sh joins part-* in name order, so the names keep their two digits.
tree_mib=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print int(s / 1048576) + 1}')
part_mib=$((64 - tree_mib - 4))
if [ "$(stat -c %s .devbundle/part-00)" -gt $((part_mib * 1048576)) ]; then
  mkdir -p .devbundle/resplit
  cat .devbundle/part-* | split -b "${part_mib}M" -d -a 2 - .devbundle/resplit/part-
  rm .devbundle/part-* && mv .devbundle/resplit/part-* .devbundle/ && rmdir .devbundle/resplit
  ls .devbundle/part-* | wc -l > .devbundle/parts
fi
rm -rf .devbundle/wheels && mkdir -p .devbundle/wheels .devbundle/acts
.venv/bin/maturin build --release -q -o .devbundle/wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .devbundle/wheels crc32c
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d .devbundle/wheels py-spy==0.4.3
# Pure-Python packages the installs (--no-deps) would miss: inotify_simple (layertap's dependency),
# loguru (compressed_tensors imports it, and registering capture in the model imports vLLM's
# qwen3_next, which imports compressed_tensors: without it check-inmodel stops at start-up).
python3 -m pip download -q --no-deps --only-binary=:all: -d .devbundle/wheels inotify_simple loguru
# nvCOMP (issue 21's codec measurement, device.sh codecs), and lz4 and zstandard to check its output on
# the CPU (the call needs no vLLM bundle, which brings zstandard otherwise).
mkdir -p .devbundle/wheels-nvcomp
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .devbundle/wheels-nvcomp nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13 lz4 zstandard
if [ -n "${OLD_COMMIT:-}" ]; then
  rm -rf .devbundle/wheels-old .devbundle/old-tree
  git worktree add -f --detach .devbundle/old-tree "$OLD_COMMIT"
  (cd .devbundle/old-tree && CARGO_TARGET_DIR=../old-target ../../.venv/bin/maturin build --release -q -o ../wheels-old)
  git worktree remove --force .devbundle/old-tree
fi
.venv/bin/python - <<'PY'
import sys
sys.path.insert(0, "benches")
from bench_writer import load_activations
from safetensors.torch import save_file
acts = load_activations("bf16")
save_file({"bf16": acts[:8192].contiguous()}, ".devbundle/acts/activations.safetensors")
save_file({"bf16": acts[:2048].contiguous()}, ".devbundle/acts/activations-2k.safetensors")  # the codecs call
PY
du -sh .devbundle/part-* .devbundle/wheels* .devbundle/acts
