#!/usr/bin/env bash
# Every measurement issue 33 needs on one machine of N GPUs (default 2), about 12 minutes on 2 H200s:
#   bash scripts/ep_wire_runs.sh [N]
# 1. scripts/ep_check.py twice (all-to-all transport; p2p transport in 2 ranges): forward and input gradient
#    bit-identical to one process at DeepSeek-V3 expert sizes;
# 2. benchmarks/bench_ep.py over NVLink, NVLink with NCCL held to one and four channels (NCCL_MAX_NCHANNELS), NCCL's
#    shared-memory transport (NCCL_P2P_DISABLE=1) and its socket transport (NCCL_P2P_DISABLE=1
#    NCCL_SHM_DISABLE=1; fewer rounds: each step takes ~0.5 s there);
#    then over NVLink with every exchange held to 50 and to 25 GB/s (bench_ep --wire-gbps: the same wire for every row;
#    the goal's 50 GB/s is read there);
# 3. scripts/ep_wire_fit.py over the seven: the slow-wire model, its check, the gains at 25/50/100 GB/s.
# Writes into $OUT (default ./out): ep_wire.log (everything printed), ep<N>_{nvlink,nvlink1ch,nvlink4ch,shm,socket}.json,
# ep<N>_wire{50,25}.json, ep<N>_fit.md, ep<N>_fit.png. Exit status 1 if a step failed (the others still run).
# STEPS="nvlink nvlink-4ch fit" runs only the named steps (check check-p2p nvlink shm nvlink-1ch nvlink-4ch socket wire-50
# wire-25 fit);
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
STEPS=${STEPS:-check check-p2p nvlink shm nvlink-1ch nvlink-4ch socket wire-50 wire-25 fit}
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
# the emulated wire (benchmarks/slow_wire.py): torchtitan's row is left out (its exchanges are not held)
WIRE_ROWS=bf16,conv_bf16,conv_mxfp8,p2p_c2,p2p_c2_sm4,p2p_c4,p2p_c4_sm4
run wire-50 timeout 200 $TR -m benchmarks.bench_ep --wire-gbps 50 --rows $WIRE_ROWS --json "$OUT/ep${N}_wire50.json"
run wire-25 timeout 200 $TR -m benchmarks.bench_ep --wire-gbps 25 --rows $WIRE_ROWS --rounds 3 --steps 3 \
  --json "$OUT/ep${N}_wire25.json"
run fit python3 scripts/ep_wire_fit.py nvlink="$OUT/ep${N}_nvlink.json" nvlink-1ch="$OUT/ep${N}_nvlink1ch.json" \
  nvlink-4ch="$OUT/ep${N}_nvlink4ch.json" \
  shm="$OUT/ep${N}_shm.json" socket="$OUT/ep${N}_socket.json" wire50="$OUT/ep${N}_wire50.json" \
  wire25="$OUT/ep${N}_wire25.json" --md "$OUT/ep${N}_fit.md" --png "$OUT/ep${N}_fit.png"
grep -E "^\[ep_check\] (PASS|FAIL)|^=== " "$LOG"
echo "=== done rc=$rc ($(date +%T))"
exit $rc
