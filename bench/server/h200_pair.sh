#!/usr/bin/env bash
# The pair issue's H200 runs (bench/notes/2026-12-05-pair-on-one-gpu.md): the parts named, in order,
# in one device call, each given an equal share of the budget left (BUDGET_S, default 540 s), every
# result under $OUT/results.tgz (the device returns at most 8 files):
#
#   probe            bench.probes.mps: what an MPS client sees (SM affinity, NVML, the daemon)
#   mpstalker        bench.probes.mps_talker: the talker's frames and stack_step under MPS limits (run 13)
#   greensplit       bench.probes.green_split: two MPS clients in disjoint green contexts (their SMs, their rates)
#   tiers:<tree>     the server under the Poisson load (2-8 s, 2 requests a stream, load seed 0) with
#                    MPS, at TIERS, on the tree in folder <tree> (. for this one; another folder
#                    carried beside it, e.g. a copy before a change, for a comparison in one call)
#   gputests         tests/gpu and the sampler's CUDA test, 14 workers stealing work (loadfile, the suite's
#                    default, kept test_stack_step_cuda.py's ~6 min of compiles on one worker)
#   pattn            bench.kernels.prefill_attention_gpu (prefill_attention_gpu.json), then the prefill
#                    attention's, prefill graphs' and device profile's tests (pattn_tests.log)
#   fusion           bench.talker.fusion's last FUSION_STAGES stages (default 2) at 1, 64, 128, 256 and 512 rows,
#                    exactness skipped (tests/gpu covers it): the frame per stage (talker_fusion.json, fusion.log)
#   t2w              bench.code2wav.token2wav_gpu: the Qwen family's Token2Wav per row bucket (token2wav_gpu.json)
#   qtalk            bench.talker.qwen_omni_gpu: the Qwen family's talker step and prefill (qwen_talker_gpu.json)
#   fault            bench.probes.pair_fault: the stack as `voxring up` starts it (--mps $MPS), kill -9 of
#                    Code2Wav with FAULT_C streams in flight (their ends, the talker's rows, the gateway's
#                    health), `voxring up` again, a few requests, down; /dev/shm and the stages checked
#                    (fault.json, fault.log)
#
#   VOXRING_COMMIT=<sha> TIERS=64,256,1024 PROFILE=1024 bench/server/h200_pair.sh probe tiers:.old tiers:.
#
# Options by environment: TIERS (default 1,64,256,512,768,1024,1536,2048), MPS (on), TOKENIZER (bpe),
# PROFILE (a tier to py-spy, whose wheel `PROFILER=1 bench/server/fetch_wheels.sh` adds; none by default),
# PROFILE_DEVICE (1: that tier's engines profile their device work too; its stop stalls them), SEQ (the sequential C=1 tier's requests, default 50),
# ARGS (more bench.server arguments), FAULT_C (the fault part's streams, default 512), STEPLOG (1: each
# tree's talker writes its step log to <tree's results>/steps.jsonl, gzipped at the end), LABEL (the results
# folder of a tiers part, where not the tree's name: the same tree run again under other settings), LIMITS and
# CHILD_S (mpstalker's MPS scenarios, '' for none, and each child's seconds), NOTESTS (1: mpstalker without
# stack_step's tests), GREEN_SMS, GREEN_S and GREEN_ONLY (greensplit's talker SMs, seconds a scenario and
# scenarios). Run from the
# repository root with `carry: [".whl", ...]`.
#
# A tiers part's share pays for, before its first tier: the checkpoint (~13 s, once a machine), the
# stages' start (~55 s with a cold Triton cache, ~16 s warm) and the warm-up; and throughout: the
# 10 s the part keeps from --max-wall and bench.server's 45 s for a tier's drain and the stop. So a
# share under ~160 s on a fresh machine (~110 s warm) runs no tier at all; 1,024 streams need ~30 s
# more, each further tier about as much.
set -uo pipefail

[ $# -gt 0 ] || { echo "usage: bench/server/h200_pair.sh PART..." >&2; exit 2; }
: "${OUT:?OUT must name the folder whose files come back}"
: "${VOXRING_COMMIT:?VOXRING_COMMIT must name the commit under test}"
BUDGET_S="${BUDGET_S:-540}"
TIERS="${TIERS:-1,64,256,512,768,1024,1536,2048}"
ROOT="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site" PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH"
# Triton's compiled kernels: a cold machine spent ~40 s of a stack's start compiling them (the same
# tree started in 15 s once they were cached). The cache comes back as triton_cache.tgz; unpacked
# into .triton-cache and carried (where the carry's 64 MiB allow), a later call starts warm.
export TRITON_CACHE_DIR="$ROOT/.triton-cache"
mkdir -p "$TRITON_CACHE_DIR"
started=$(date +%s)
R=/tmp/voxring-pair
mkdir -p "$R"
left() { local n=$(( BUDGET_S - ($(date +%s) - started) )); echo $(( n > 1 ? n : 1 )); }
pack() {
  tar czf "$OUT/results.tgz" -C "$R" . 2>/dev/null
  tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
}
trap pack EXIT

{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv
  python3 -c "import sys, torch, triton, grpc; print(sys.version.split()[0], torch.__version__,
triton.__version__, grpc.__version__)"
  echo "commit $VOXRING_COMMIT; parts: $*"
} > "$R/machine.txt" 2>&1

n=$#
i=0
for part in "$@"; do
  share=$(( ($(left) - 5) / (n - i) )); i=$((i + 1))
  case "$part" in
    probe)
      timeout "$share" python3 -m bench.probes.mps --out "$R/mps_probe.json" > /dev/null 2>&1
      echo "probe: exit $?" ;;
    mpstalker)
      timeout "$share" python3 -m bench.probes.mps_talker --timeout "${CHILD_S:-150}" --limits "${LIMITS-none,75,50}" \
        ${NOTESTS:+--no-tests} --out "$R/mps_talker.json" > /dev/null 2>&1
      echo "mpstalker: exit $?" ;;
    greensplit)
      timeout "$share" python3 -m bench.probes.green_split --talker-sms "${GREEN_SMS:-96}" --seconds "${GREEN_S:-8}" \
        ${GREEN_ONLY:+--scenarios "$GREEN_ONLY"} --out "$R/green_split.json" > "$R/green_split.log" 2>&1
      echo "greensplit: exit $?"; tail -n 3 "$R/green_split.log" ;;
    tiers:*)
      tree="${part#tiers:}"; label=$(basename "$(cd "$tree" && pwd)"); [ "$tree" = . ] && label=head
      label="${LABEL:-$label}"
      mkdir -p "$R/$label"
      steplog=""; [ "${STEPLOG:-0}" = 1 ] && steplog="$R/$label/steps.jsonl"
      (cd "$tree" && { [ -z "$steplog" ] || export VOXRING_TALKER__ENGINE__STEP_LOG="$steplog"; } &&
        PYTHONPATH="/tmp/site:$PWD" timeout "$share" python3 -m bench.server --part tiers \
        --mps "${MPS:-on}" --load poisson --audio-seconds 2,8 --requests-per-stream 2 --load-seed 0 \
        --tiers "$TIERS" --tokenizer "${TOKENIZER:-bpe}" --sequential-requests "${SEQ:-50}" \
        ${PROFILE:+--profile-tier "$PROFILE"} $([ "${PROFILE_DEVICE:-0}" = 1 ] && echo --profile-device) --max-wall $((share - 10)) --out "$R/$label" ${ARGS:-} \
        > "$R/$label/run.log" 2>&1)
      echo "tiers $label: exit $?"; tail -n 30 "$R/$label/run.log" | grep -E "^C=|tier|MPS"
      if [ -n "$steplog" ] && [ -f "$steplog" ]; then gzip -f "$steplog"; fi ;;
    gputests)
      # -v names each test as it ends, SIGINT makes pytest print its summary and durations when cut
      timeout -s INT -k 30 "$share" python3 -m pytest -v -rfE -W ignore -p no:cacheprovider -n 14 --dist worksteal \
        --durations=30 tests/gpu tests/unit/test_sampler.py > "$R/gpu_tests.log" 2>&1
      echo "gpu tests: exit $?"; grep -E "^(FAILED|ERROR)|(FAILED|ERROR) tests/" "$R/gpu_tests.log" | head -n 20
      tail -n 3 "$R/gpu_tests.log" ;;
    pattn)
      timeout "$share" python3 -m bench.kernels.prefill_attention_gpu --out "$R/prefill_attention_gpu.json" \
        > "$R/pattn.log" 2>&1
      echo "pattn: exit $?"; tail -n 16 "$R/pattn.log"
      timeout -s INT -k 15 "${PATTN_TESTS_S:-100}" python3 -m pytest -q -rfE -W ignore -p no:cacheprovider -n 4 \
        tests/unit/test_kernel_prefill_attention.py tests/gpu/test_prefill_graphs_cuda.py \
        tests/gpu/test_device_profile_cuda.py > "$R/pattn_tests.log" 2>&1
      echo "pattn tests: exit $?"; tail -n 4 "$R/pattn_tests.log" ;;
    fusion)
      timeout "$share" python3 -m bench.talker.fusion --last-stages "${FUSION_STAGES:-2}" --skip-exactness \
        --buckets 1,64,128,256,512 --out "$R/talker_fusion.json" > "$R/fusion.log" 2>&1
      echo "fusion: exit $?"; grep -E "B=1:" "$R/fusion.log" ;;
    t2w)
      timeout "$share" python3 -m bench.code2wav.token2wav_gpu --out "$R/token2wav_gpu.json" > "$R/t2w.log" 2>&1
      echo "t2w: exit $?"; tail -n 6 "$R/t2w.log" ;;
    qtalk)
      timeout "$share" python3 -m bench.talker.qwen_omni_gpu --out "$R/qwen_talker_gpu.json" > "$R/qtalk.log" 2>&1
      echo "qtalk: exit $?"; tail -n 4 "$R/qtalk.log" ;;
    fault)
      timeout "$share" python3 -m bench.probes.pair_fault --concurrency "${FAULT_C:-512}" --mps "${MPS:-on}" \
        --max-wall $(( share > 60 ? share - 30 : share )) --out "$R/fault.json" > "$R/fault.log" 2>&1
      echo "fault: exit $?"; tail -n 11 "$R/fault.log" | cut -c1-400 ;;
    *) echo "unknown part $part" >&2 ;;
  esac
done
cd "$ROOT"
