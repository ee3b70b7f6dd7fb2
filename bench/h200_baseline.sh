#!/usr/bin/env bash
# The H200 baseline at a commit, in three device calls of under 10 minutes each (bench/README.md,
# "On the GPU machine"), each writing under $OUT as it goes:
#
#   bench/h200_baseline.sh tests    # tests/gpu and test_sampler.py (its CUDA test), then the talker steps
#   bench/h200_baseline.sh costs    # prefill, Code2Wav's decode grid, the bf16 graph probe, the overlap
#   bench/h200_baseline.sh server   # the whole server under the Poisson load, MPS off then on
#
# Run from the repository root with `carry: [".whl"]`; set VOXRING_COMMIT (the device's copy of the
# tree has no .git). Each part stops itself before the device's 10-minute limit.
set -uo pipefail

part="${1:?usage: bench/h200_baseline.sh tests|costs|server}"
: "${OUT:?OUT must name the folder whose files come back}"
: "${VOXRING_COMMIT:?VOXRING_COMMIT must name the commit under test}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
started=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - started) )); }  # seconds of a budget still left

{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv
  python3 -c "import sys, torch, triton, grpc; print(sys.version.split()[0], torch.__version__,
triton.__version__, grpc.__version__)"
} > "$OUT/machine_$part.txt" 2>&1

case "$part" in
  tests)
    # 6 workers: most of the suite's time is Triton compiling on the host's 16 cores
    timeout 360 python3 -m pytest -q -rfE --timeout 340 -p no:cacheprovider -n 6 \
      tests/gpu tests/unit/test_sampler.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    echo "tests: exit ${PIPESTATUS[0]}"
    timeout "$(left 500)" python3 bench/steps_gpu.py --parts talker --out "$OUT/steps_gpu_talker.json"
    echo "talker steps: exit $?"
    ;;
  costs)
    timeout 220 python3 bench/steps_gpu.py --parts prefill,codec --out "$OUT/steps_gpu_costs.json"
    echo "prefill, codec: exit $?"
    timeout "$(left 320)" python3 bench/codec_graph_bf16.py --out "$OUT/codec_graph_bf16.json" 2>&1 | tail -8
    echo "codec graph bf16: exit ${PIPESTATUS[0]}"
    timeout "$(left 520)" python3 bench/overlap_gpu.py --seconds 5 --out "$OUT/overlap_gpu.json"
    echo "overlap: exit $?"
    ;;
  server)
    R=/tmp/voxring-bench-results
    for mps in off on; do
      if [ "$mps" = off ]; then until=265; else until=540; fi
      timeout "$(left $until)" python3 -m bench.server --part tiers --mps "$mps" --load poisson \
        --tiers 1,8,64,256,1024 --requests-per-stream 2 --max-wall "$(( $(left $until) - 10 ))" --out "$R"
      echo "server tiers, MPS $mps: exit $?"
    done
    python3 -m bench.server --part report --out "$R" > /dev/null
    cp "$R"/server_gpu_tiers_*poisson*.json "$R"/server_gpu.md "$OUT"/ 2>/dev/null
    ;;
  *)
    echo "unknown part $part" >&2
    exit 2
    ;;
esac
