set -u
VOXRING_COMMIT=$C BUDGET_S=400 bash bench/server/h200_pair.sh gputests fusion
export PYTHONPATH=/tmp/site TRITON_CACHE_DIR=$PWD/.triton-cache
mkdir -p /tmp/new && tar c --exclude=./bench/results --exclude=./.oldfiles --exclude=./.newfiles --exclude=./.whl . | tar x -C /tmp/new && cp -r .newfiles/. /tmp/new/
timeout 70 python3 -m bench.code2wav.replay_kernels --out $OUT/replay_mid.json > $OUT/replay_mid.log 2>&1; echo "mid $?"
(cd /tmp/new && PYTHONPATH=/tmp/site:$PWD timeout 70 python3 -m bench.code2wav.replay_kernels --out $OUT/replay_new.json > $OUT/replay_new.log 2>&1; echo "new $?")
tail -n 8 $OUT/replay_mid.log $OUT/replay_new.log
timeout 120 python3 -m bench.talker.prefill_paths --out $OUT/prefill_paths.json > $OUT/prefill_paths.log 2>&1; echo "prefill_paths $?"
tail -n 8 $OUT/prefill_paths.log
