# Run 40 (bench notes, "Twentieth session"): prefill's two paths, the GPU suite, then the codec's replay
# kernels of this tree and of the candidate in .newfiles2/ (FUSION=1: the frame's last two fusion stages
# after the suite).
set -u
export PYTHONPATH=/tmp/site TRITON_CACHE_DIR=$PWD/.triton-cache
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
timeout 90 python3 -m bench.talker.prefill_paths --out $OUT/prefill_paths.json > $OUT/prefill_paths.log 2>&1
echo "prefill_paths $?"; tail -n 8 $OUT/prefill_paths.log
if [ "${FUSION:-0}" = 1 ]; then parts="gputests fusion"; budget=330; else parts=gputests; budget=170; fi
VOXRING_COMMIT=$C BUDGET_S=$budget bash bench/server/h200_pair.sh $parts
for v in mid new2; do  # this tree, then the candidate's copy
  tree=.; if [ $v != mid ]; then tree=/tmp/$v; mkdir -p $tree
    tar c --exclude=./bench/results --exclude=./.oldfiles --exclude='./.newfiles*' --exclude=./.whl . | tar x -C $tree
    cp -r .newfiles${v#new}/. $tree/; fi
  (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 40 python3 -m bench.code2wav.replay_kernels --out /tmp/replay_$v.json \
    > /tmp/replay_$v.log 2>&1; echo "$v $?"); tail -n 6 /tmp/replay_$v.log
done
tar czf $OUT/replay.tgz -C /tmp replay_mid.json replay_new2.json replay_mid.log replay_new2.log
