#!/usr/bin/env bash
# The H200 baseline at a commit (bench/README.md, "On the GPU machine"): the parts named, in order, in
# one device call, each stopped before the call's budget (BUDGET_S, default 570 s) runs out, each
# writing under $OUT as it goes:
#
#   tests        tests/gpu and tests/unit/test_sampler.py (its CUDA test)
#   talker       the talker's whole decode step per (bucket, K)       -> steps_gpu_talker.json
#   costs        prefill (eager and through its graphs), Code2Wav's decode grid, the bf16 graph
#                probe, the talker/Code2Wav overlap
#   server-off   the whole server under each load of LOADS (default poisson) at TIERS (default
#                1,8,64,256,1024), without MPS; the call's time left is shared between the loads
#   server-on    the same with MPS (then the table of both)
#   determinism  Code2Wav's bf16 decode with cuDNN deterministic (the default) and free: the GPU
#                test, the decode grid both ways (same call), the graph/eager probe
#
#   bench/server/h200_baseline.sh tests talker      # e.g.
#
# Run from the repository root with `carry: [".whl"]`; set VOXRING_COMMIT (the device's copy of the
# tree has no .git).
set -uo pipefail

[ $# -gt 0 ] || { echo "usage: bench/server/h200_baseline.sh PART..." >&2; exit 2; }
: "${OUT:?OUT must name the folder whose files come back}"
: "${VOXRING_COMMIT:?VOXRING_COMMIT must name the commit under test}"
BUDGET_S="${BUDGET_S:-570}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
started=$(date +%s)
left() {  # seconds until a point of the budget (at least 1: timeout takes no negative limit)
  local n=$(( ${1:-$BUDGET_S} - ($(date +%s) - started) )); echo $(( n > 1 ? n : 1 ))
}
R=/tmp/voxring-bench-results  # outside the tree: a later call on the still-warm machine finds it

{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv
  python3 -c "import sys, torch, triton, grpc; print(sys.version.split()[0], torch.__version__,
triton.__version__, grpc.__version__)"
} > "$OUT/machine.txt" 2>&1

TIERS="${TIERS:-1,8,64,256,1024}"
read -r -a LOADS <<< "${LOADS:-poisson}"

server() {  # $1: off or on; each load gets an equal share of the time left
  local n=${#LOADS[@]} i=0 wall
  for load in "${LOADS[@]}"; do
    wall=$(( ($(left) - 10) / (n - i) )); i=$((i + 1))
    timeout "$((wall + 5))" python3 -m bench.server --part tiers --mps "$1" --load "$load" \
      --tiers "$TIERS" --requests-per-stream 2 --max-wall "$wall" --out "$R"
    echo "server tiers, MPS $1, $load: exit $?"
  done
  python3 -m bench.server --part report --out "$R" > /dev/null
  cp "$R"/server_gpu_tiers_*.json "$R"/server_gpu.md "$R"/*.png "$OUT"/ 2>/dev/null
}

for part in "$@"; do
  case "$part" in
    tests)  # 14 workers: most of the suite's time is Triton compiling on the host's 16 cores (with
      # fewer, the suite outgrew this part's share of the budget: bench/notes/README.md, the H200 verification)
      timeout "$(left $((BUDGET_S - 180)))" python3 -m pytest -q -rfE -W ignore --timeout 200 -p no:cacheprovider -n 14 \
        tests/gpu tests/unit/test_sampler.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
      echo "tests: exit ${PIPESTATUS[0]}" ;;
    talker)
      timeout "$(left)" python3 -m bench.server.steps --parts talker --out "$OUT/steps_gpu_talker.json"
      echo "talker steps: exit $?" ;;
    costs)
      timeout 240 python3 -m bench.server.steps --parts prefill,prefill_graphs,codec --out "$OUT/steps_gpu_costs.json"
      echo "prefill, codec: exit $?"
      timeout "$(left 320)" python3 -m bench.code2wav.codec_graph_bf16 --out "$OUT/codec_graph_bf16.json" 2>&1 | tail -8
      echo "codec graph bf16: exit ${PIPESTATUS[0]}"
      timeout "$(left)" python3 -m bench.server.overlap --seconds 5 --out "$OUT/overlap_gpu.json"
      echo "overlap: exit $?" ;;
    determinism)
      timeout 120 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_codec_cuda.py 2>&1 \
        | tee "$OUT/gpu_tests_codec.log" | tail -5
      for mode in deterministic nondeterministic; do
        flag=$([ "$mode" = nondeterministic ] && echo --codec-nondeterministic)
        timeout 120 python3 -m bench.server.steps --parts codec $flag --out "$OUT/steps_gpu_codec_$mode.json" \
          | tail -5
        echo "codec grid, $mode: exit ${PIPESTATUS[0]}"
      done
      timeout "$(left)" python3 -m bench.code2wav.codec_graph_bf16 --out "$OUT/codec_graph_bf16.json" 2>&1 | tail -8
      echo "codec graph bf16: exit ${PIPESTATUS[0]}" ;;
    server-off) server off ;;
    server-on) server on ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
