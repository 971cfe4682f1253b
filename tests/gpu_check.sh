#!/bin/bash
# GPU check, one GPU (not part of the suite: CI has no GPU). CUDA parameters and Adam
# state through the state transfer, 2 ranks + 1 spare sharing cuda:0 over gloo (NCCL
# refuses two ranks on one GPU): a rank SIGKILLed mid-step, then a planned migration;
# every rank of each must end with the failure-free torchrun run's checksum (exit 1 if
# not). Run from anywhere: bash tests/gpu_check.sh
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-$(mktemp -d)}
S=tests/scripts/cuda_train.py
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPU(s)')"
sums() { sed -n 's/^FINAL rank [0-9]* pid [0-9]* //p' "$1" | sort -u; }
fail=0
check() {  # name log
    grep -E "tp-run: (failure|migration|error)" "$2"
    [ "$(sums "$2")" = "$REF" ] && [ "$(grep -c '^FINAL' "$2")" = 2 ] \
        && echo "$1: every rank ends with $REF" || { echo "$1: FAILED ($(sums "$2" | tr '\n' ' '))"; fail=1; }
}
PLAIN=1 timeout 240 python3 -m torch.distributed.run --nproc-per-node 2 $S > $OUT/ref.log 2>&1
REF=$(sums $OUT/ref.log)
echo "failure-free under torchrun: $REF"
[ -n "$REF" ] && [ "$(echo "$REF" | wc -l)" = 1 ] || { echo "reference run failed"; exit 1; }

OUTDIR=$(mktemp -d) KILL_STEP=12 timeout 300 python3 -m tp_launch --nproc-per-node 2 \
    --spares 1 $S > $OUT/kill.log 2>&1
check "rank 1 SIGKILLed in step 12" $OUT/kill.log

STEP_SLEEP=1.2 timeout 300 python3 -m tp_launch --nproc-per-node 2 --spares 1 $S \
    > $OUT/migrate.log 2>&1 &
job=$!
sleep 5
for _ in $(seq 1 40); do python3 -m tp_launch migrate --rank 1 2>/dev/null && break; sleep 1; done
wait $job
check "rank 1 migrated to the spare" $OUT/migrate.log
exit $fail
