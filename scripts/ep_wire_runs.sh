#!/usr/bin/env bash
# Every measurement issue 33 needs on one machine of N GPUs (default 2), about 9 minutes on 2 H200s:
#   bash scripts/ep_wire_runs.sh [N]
# 1. scripts/ep_check.py twice (all-to-all transport; p2p transport in 2 ranges): forward and input gradient
#    bit-identical to one process at DeepSeek-V3 expert sizes;
# 2. benchmarks/bench_ep.py over NVLink, NVLink with NCCL held to one and four channels (NCCL_MAX_NCHANNELS), NCCL's
#    shared-memory transport (NCCL_P2P_DISABLE=1) and its socket transport (NCCL_P2P_DISABLE=1
#    NCCL_SHM_DISABLE=1; fewer rounds: each step takes ~0.5 s there);
# 3. scripts/ep_wire_fit.py over the five: the slow-wire model, its check, the gains at 25/50/100 GB/s.
# Writes into $OUT (default ./out): ep_wire.log (everything printed), ep<N>_{nvlink,nvlink1ch,nvlink4ch,shm,socket}.json,
# ep<N>_fit.md, ep<N>_fit.png. Exit status 1 if a step failed (the others still run).
# STEPS="nvlink nvlink-4ch fit" runs only the named steps (check check-p2p nvlink shm nvlink-1ch nvlink-4ch socket fit);
# the fit reads the JSONs in $OUT, so it can run later, on any machine, once the others are there.
set -uo pipefail
OUT=${OUT:-out}
N=${1:-2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
LOG="$OUT/ep_wire.log"
: > "$LOG"
rc=0
STEPS=${STEPS:-check check-p2p nvlink shm nvlink-1ch nvlink-4ch socket fit}
run() {  # run NAME [VAR=value ...] command ...
  local name=$1
  shift
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name ($(date +%T))" | tee -a "$LOG"
  env "$@" >> "$LOG" 2>&1 || { echo "=== $name FAILED rc=$?" | tee -a "$LOG"; rc=1; }
}
TR="torchrun --nproc_per_node $N"
run check timeout 200 $TR scripts/ep_check.py
run check-p2p timeout 150 $TR scripts/ep_check.py --transport p2p --chunks 2
run nvlink timeout 150 $TR -m benchmarks.bench_ep --json "$OUT/ep${N}_nvlink.json"
run shm NCCL_P2P_DISABLE=1 timeout 150 $TR -m benchmarks.bench_ep --json "$OUT/ep${N}_shm.json"
# NVLink with NCCL held to one and to four channels: slower wires that are still NVLink, measured (one channel gave
# 14.4 GB/s per GPU on 2 H200s; four aim near the 50 GB/s of a 400 Gb/s inter-node link; each fitted bandwidth is
# in the fit's table)
run nvlink-1ch NCCL_MIN_NCHANNELS=1 NCCL_MAX_NCHANNELS=1 timeout 150 $TR -m benchmarks.bench_ep \
  --json "$OUT/ep${N}_nvlink1ch.json"
run nvlink-4ch NCCL_MIN_NCHANNELS=4 NCCL_MAX_NCHANNELS=4 timeout 150 $TR -m benchmarks.bench_ep \
  --json "$OUT/ep${N}_nvlink4ch.json"
run socket NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout 200 $TR -m benchmarks.bench_ep --rounds 2 --steps 2 \
  --json "$OUT/ep${N}_socket.json"
run fit python3 scripts/ep_wire_fit.py nvlink="$OUT/ep${N}_nvlink.json" nvlink-1ch="$OUT/ep${N}_nvlink1ch.json" \
  nvlink-4ch="$OUT/ep${N}_nvlink4ch.json" \
  shm="$OUT/ep${N}_shm.json" socket="$OUT/ep${N}_socket.json" --md "$OUT/ep${N}_fit.md" --png "$OUT/ep${N}_fit.png"
grep -E "^\[ep_check\] (PASS|FAIL)|^=== " "$LOG"
echo "=== done rc=$rc ($(date +%T))"
exit $rc
