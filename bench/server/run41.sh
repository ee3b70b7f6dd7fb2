# Runs 41 and 44 (bench notes): on an H100 the server A/B of this tree against the
# tree in .oldfiles/ laid over a copy, BPE 1,024 and 2,048 with step logs; on an H200 the
# whole BPE table of this tree.
set -u
export STEPLOG=1 VOXRING_COMMIT=$C
# a warm machine keeps the last call's results, and bench.server skips the tiers they hold: start clean
rm -rf /tmp/voxring-pair /tmp/old
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  BUDGET_S=${BUDGET:-480} bash bench/server/h200_pair.sh tiers:.
else
  mkdir -p /tmp/old && tar c --exclude=./bench/results --exclude=./.oldfiles --exclude='./.newfiles*' \
    --exclude=./.whl . | tar x -C /tmp/old && cp -r .oldfiles/. /tmp/old/
  TIERS=1024,2048 BUDGET_S=${BUDGET:-480} bash bench/server/h200_pair.sh tiers:/tmp/old tiers:.
  # the two arms side by side (also in results.tgz: bench.server.ab reads them here again)
  PYTHONPATH="/tmp/site:$PWD" python3 -m bench.server.ab /tmp/voxring-pair/old /tmp/voxring-pair/head | cut -c1-2000
fi
