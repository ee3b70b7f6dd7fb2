# Run 47 (bench notes): on an H200 the tip's whole BPE table and the byte table past 512; on an
# H100 BPE in two stacks, the arrival cut at 40 ms (TIERS, default 1,024 and 2,048; share S1 s)
# and at its default 25 ms (1,024; share S2 s, the machine warm by then). BUDGET (default 530 s)
# is an H200 call's.
set -u
export STEPLOG=1 VOXRING_COMMIT=$C
B=${BUDGET:-530}
rm -rf /tmp/voxring-pair
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  LABEL=bpe BUDGET_S=$((B * 62 / 100)) bash bench/server/h200_pair.sh tiers:.
  TOKENIZER=byte LABEL=byte TIERS=512,768,1024,1536 BUDGET_S=$((B * 38 / 100)) bash bench/server/h200_pair.sh tiers:.
else
  VOXRING_TALKER__ENGINE__ARRIVAL_STEP_S=0.040 TIERS=${TIERS:-1024,2048} LABEL=cut40 BUDGET_S=${S1:-140} \
    bash bench/server/h200_pair.sh tiers:.
  TIERS=1024 LABEL=cut25 BUDGET_S=${S2:-100} bash bench/server/h200_pair.sh tiers:.
  PYTHONPATH="/tmp/site:$PWD" python3 -m bench.server.ab /tmp/voxring-pair/cut25 /tmp/voxring-pair/cut40 | cut -c1-2000
fi
