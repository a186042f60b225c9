#!/bin/bash
# What a device-tool call would send: the working tree that travels (tracked files and untracked files git does not
# ignore) plus the carried paths given, against the tool's 64 MiB. Run it here before a call:
#   bash experiments/carry_size.sh .gpu/whl .gpu_faiss       # exit 1 (and says so) when over the limit
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT=$((64 * 1024 * 1024))
tree=$(git ls-files -co --exclude-standard -z | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
total=$tree
printf '%-40s %8.1f MiB\n' "working tree (tracked + untracked)" "$(echo "$tree / 1048576" | bc -l)"
for p in "$@"; do
  if [ ! -e "$p" ]; then echo "error: $p does not exist here (prepare it first)" >&2; exit 2; fi
  n=$(find "$p" -type f -print0 | xargs -0 -r stat -c %s | awk '{s += $1} END {print s + 0}')
  total=$((total + n))
  printf '%-40s %8.1f MiB\n' "$p" "$(echo "$n / 1048576" | bc -l)"
done
printf '%-40s %8.1f MiB of 64\n' "total" "$(echo "$total / 1048576" | bc -l)"
if [ "$total" -gt "$LIMIT" ]; then echo "over the device tool's 64 MiB: carry less" >&2; exit 1; fi
