#!/usr/bin/env bash
# On a machine with NVIDIA GPUs: what the probe sees (NVML), a calibration with NCCL (convolutions
# included), and verify's predicted-against-measured table on reference models of real size. Each step has a time limit
# and the next one runs whatever it ended with. Run from the repository root:
#   bash bench/gpu_check.sh [OUT_DIR]        (default out/gpu-check; PYTHON picks the interpreter)
# The calibration goes to OUT_DIR/cache, where advise and verify below find it, and the log to
# OUT_DIR/log.
set -u
out=${1:-out/gpu-check}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 STRATAGEM_CACHE_DIR=$out/cache
py=${PYTHON:-python3}

step() {
    local limit=$1 started=$SECONDS
    shift
    echo "== $* (limit ${limit} s)"
    timeout "$limit" "$py" -m stratagem "$@"
    echo "== exit $? after $((SECONDS - started)) s"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$py" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())'
    step 30 hardware
    step 90 calibrate
    # cases the cost model was not tuned on; each verify's top 2 include a compiled plan where it ranks there
    step 120 verify --model gpt2-medium --global-batch-size 8 --seq-len 1024 --top 2 --output "$out/gpt2-medium-plan.json"
    step 100 verify --model vit-b-16 --global-batch-size 128 --top 2
    step 100 verify --model resnet-50 --global-batch-size 256 --top 2
    step 150 verify --model llama-2-7b --global-batch-size 8 --seq-len 1024 --top 1
    echo "== a Hugging Face Qwen2 (0.5B's shape) through Trainer(strategy=\"auto-parallel\") (limit 120 s)"
    timeout 120 "$py" bench/trainer_hf.py --accelerator gpu --batch 4 --seq-len 1024
    echo "== exit $?"
} 2>&1 | tee "$out/log"
