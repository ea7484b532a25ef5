#!/usr/bin/env bash
# The disk's sequential write bandwidth with dd: buffered + fsync, and O_DIRECT.
# usage: benches/gpu/disk.sh RESULTS_DIR [GiB]   (SCRATCH as in run.sh)
set -euo pipefail
results=$1; gib=${2:-8}
scratch=${SCRATCH:-/var/tmp/layertap-bench}
mkdir -p "$results" "$scratch"
f="$scratch/dd.bin"
measure() {
  local flag=$1 t0 t1
  sync; t0=$(date +%s.%N)
  dd if=/dev/zero of="$f" bs=8M count=$((gib * 128)) $flag status=none
  t1=$(date +%s.%N); rm -f "$f"
  python3 -c "print(round($gib * 2**30 / ($t1 - $t0) / 1e9, 3))"
}
buffered=$(measure conv=fsync)
direct=$(measure oflag=direct)
df -h "$scratch" > "$results/disk-df.txt"
echo "{\"dd_buffered_fsync_gbps\": $buffered, \"dd_odirect_gbps\": $direct, \"gib\": $gib}" | tee "$results/disk.json"
