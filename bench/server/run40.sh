# Run 40 (bench notes, "Twentieth session"): prefill's two paths, the GPU suite, the frame's last two
# fusion stages, then the codec's replay kernels of this tree and of a candidate in .newfiles/.
set -u
export PYTHONPATH=/tmp/site TRITON_CACHE_DIR=$PWD/.triton-cache
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
timeout 100 python3 -m bench.talker.prefill_paths --out $OUT/prefill_paths.json > $OUT/prefill_paths.log 2>&1
echo "prefill_paths $?"; tail -n 8 $OUT/prefill_paths.log
VOXRING_COMMIT=$C BUDGET_S=330 bash bench/server/h200_pair.sh gputests fusion
mkdir -p /tmp/new && tar c --exclude=./bench/results --exclude=./.oldfiles --exclude=./.newfiles --exclude=./.whl . | tar x -C /tmp/new && cp -r .newfiles/. /tmp/new/
timeout 50 python3 -m bench.code2wav.replay_kernels --out $OUT/replay_mid.json > $OUT/replay_mid.log 2>&1; echo "mid $?"
(cd /tmp/new && PYTHONPATH=/tmp/site:$PWD timeout 50 python3 -m bench.code2wav.replay_kernels --out $OUT/replay_new.json > $OUT/replay_new.log 2>&1; echo "new $?")
tail -n 6 $OUT/replay_mid.log $OUT/replay_new.log
