#!/bin/bash
# GPU check, one GPU (not part of the suite: CI has no GPU). CUDA parameters and Adam
# state through the state transfer, 2 ranks + 1 spare sharing cuda:0 over gloo (NCCL
# refuses two ranks on one GPU): a rank SIGKILLed mid-step, then a planned migration;
# each tp-run result must equal the failure-free torchrun run's. Run from the repository
# root: bash tests/gpu_check.sh
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
OUT=${OUT:-$(mktemp -d)}
S=tests/scripts/cuda_train.py
nvidia-smi -L
python3 -c "import torch, click, psutil; print('torch', torch.__version__, torch.cuda.is_available(), torch.cuda.device_count())" || exit 1
export OUTDIR=$(mktemp -d)
echo "== failure-free under torchrun"
PLAIN=1 timeout 240 python3 -m torch.distributed.run --nproc-per-node 2 $S 2>&1 | grep -E "FINAL|Error|error" | head -20
echo "== tp-run, rank 1 SIGKILLed in step 12, spare promoted"
KILL_STEP=12 timeout 300 python3 -m tp_launch --nproc-per-node 2 --spares 1 $S > $OUT/tp.log 2>&1; echo "tp-run rc=$?"
grep -E "FINAL|tp-run: |Error" $OUT/tp.log | head -20
ls $OUTDIR
export OUTDIR=$(mktemp -d)
echo "== failure-free under torchrun"
PLAIN=1 timeout 240 python3 -m torch.distributed.run --nproc-per-node 2 $S 2>&1 | grep -E "FINAL|Error" | head
echo "== tp-run, planned migration of rank 1 to the spare (CUDA state through the transfer)"
STEP_SLEEP=1.2 timeout 300 python3 -m tp_launch --nproc-per-node 2 --spares 1 $S > $OUT/tp2.log 2>&1 &
job=$!
sleep 5
for i in $(seq 1 40); do python3 -m tp_launch migrate --rank 1 2>&1 && { echo "migrate ok after $i tries"; break; }; sleep 1; done
wait $job; echo "tp-run rc=$?"
grep -E "FINAL|tp-run: |Error|migrat" $OUT/tp2.log | head -20
