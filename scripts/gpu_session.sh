#!/usr/bin/env bash
# The GPU work of one session, in stages that each fit one device call (10 minutes).
# Run from the repo root on the device: `bash scripts/gpu_session.sh STAGE`; outputs go
# to $OUT (at most 8 files come back, so the bench folder travels as one tarball).
#   check   make test-gpu + make memcheck            (~6 min)
#   bench   flashtile bench, the default sweep, in --append parts (~8 min)
#   extra   bench --accuracy, bench --decode, tune for head_dim 128 (~8 min)
set -uo pipefail
export TRITON_CACHE_DIR=$PWD/.triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export FLASHTILE_CACHE_DIR=$PWD/.ftcache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "${1:-}" in
  check)
    make memcheck 2>&1 | tail -4 | tee "$OUT/memcheck.txt"
    make test-gpu GPU_LOG="$OUT/gpu-tests.txt" 2>&1 | tail -4
    ;;
  bench)
    for d in 64 128; do
      for c in false true; do
        timeout 140 python3 -m flashtile bench --headdim $d --causal $c --no-progress \
          --seqlens 512 1k 2k 4k 8k 16k 32k --out bench-h200 --append >/dev/null 2>&1
        echo "head_dim $d causal $c rc=$?"
      done
    done
    tar czf "$OUT/bench.tgz" bench-h200
    tail -30 bench-h200/results.md
    ;;
  extra)
    timeout 150 python3 -m flashtile bench --accuracy --out extra 2>&1 | tail -20
    timeout 150 python3 -m flashtile bench --decode --out extra 2>&1 | tail -12
    timeout 240 python3 -m flashtile tune --headdim 128 2>&1 | tail -20
    cp .ftcache/tuned-configs.json extra/ 2>/dev/null
    tar czf "$OUT/extra.tgz" extra
    ;;
  *)
    echo "usage: $0 check|bench|extra" >&2
    exit 2
    ;;
esac
