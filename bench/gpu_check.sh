#!/usr/bin/env bash
# On a machine with NVIDIA GPUs: what the probe sees (NVML), a calibration with NCCL (convolutions and
# attention included), then verify's predicted-against-measured table on models of real size the cost model
# was never tuned on (the cases of 2026-11-26, 27 and 28 have been since: bench/gpu_predictions.py keeps
# what they measured, docs/benchmarks.md the tables): OPT-1.3B's shape (hf:, bench/configs/), whose
# offloaded step missed by -83 % on 2026-11-28 through the calibration's host optimizer (timed on the
# GPU; fixed since), and four never run: StableLM-2-1.6B's shape (partial rotary, LayerNorm, QKV biases),
# compiled and offloaded; a user's own CNN through a factory (examples/advise_own_model.py: GroupNorm,
# 3x3 convolutions, GELU); Gemma-2-2B's shape with its soft-capped attention written out (eager:
# bench/configs/gemma-2-2b-eager names it, where transformers 4.x runs SDPA and drops the soft-capping);
# and Phi-2's shape (parallel attention and MLP) through Trainer(strategy="auto-parallel").
# On one GPU each verify's top 2 are the compiled plan and the offloaded one. Then the mechanisms, most telling
# first: operators without FLOPs by kind against a copy (bench/reduction_rate.py), BLOOM-560M's offloaded step
# by phase (bench/offload_phases.py), the host's optimizer by tensor size against its last-level cache
# (bench/host_optimizer_cache.py), the compiled transformer steps' kernels by family (BLOOM-560M, GPT-2 large,
# the Pythia-shaped hf: config, ViT-L/16), the gaps between them split into the host's and the
# device's by phase (bench/gpu_kernels.py), the attention core's rate by sequence, head width and
# causality (bench/attention_rate.py) and BatchNorm's kernels by shape, dtype and layout
# (bench/batch_norm_rate.py). In parts of their own: ResNet-101 compiled block by block, the largest
# miss recorded, by kernel family and gap (bench/gpu_kernels.py; its compile outran 100 s in the
# mechanisms twice), and ResNet-50 eager in NCHW against channels-last (what the advice predicts that
# layout saves), and Nsight Compute's bytes of GPT-2 large's Triton kernels. Each step has a time
# limit and the next one runs whatever it ended with: the table's steps limits about 10 minutes in all
# (the cases of 2026-11-28 took 5.3 and 7.1 minutes), the mechanisms' 7 (5.2 on 2026-11-28), ResNet's
# 5.5, Nsight Compute's 3, so that each part fits one call of a lent machine. Run from the repository root:
#   bash bench/gpu_check.sh [OUT_DIR] [table|mechanisms|resnet|nsight|all]   (default out/gpu-check, all;
#                                                                      PYTHON picks the interpreter)
# The log goes to OUT_DIR/log-PART, the calibration file beside it; advise and verify read the
# calibration from the cache ($STRATAGEM_CACHE_DIR, default OUT_DIR/cache).
set -u
out=${1:-out/gpu-check}
part=${2:-all}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export STRATAGEM_CACHE_DIR=${STRATAGEM_CACHE_DIR:-$out/cache}
py=${PYTHON:-python3}

run() {
    local limit=$1 started=$SECONDS
    shift
    echo "== $* (limit ${limit} s)"
    timeout "$limit" "$@"
    echo "== exit $? after $((SECONDS - started)) s"
}

table() {
    run 30 "$py" -m stratagem hardware
    run 80 "$py" -m stratagem calibrate
    cp "$STRATAGEM_CACHE_DIR"/calibration/*.json "$out"/ 2>/dev/null
    # a Hugging Face layer compiles a graph of its own (its layer_idx): 24 here (99 s on 2026-11-28)
    run 110 "$py" -m stratagem verify --model hf:bench/configs/opt-1.3b --global-batch-size 8 --seq-len 1024 --top 2
    run 110 "$py" -m stratagem verify --model hf:bench/configs/stablelm-2-1.6b --global-batch-size 8 --seq-len 1024 \
        --top 2
    run 60 env PYTHONPATH="$PWD/examples:$PYTHONPATH" "$py" -m stratagem verify --model advise_own_model:build \
        --global-batch-size 64 --top 2
    # Gemma 2's logit soft-capping takes no SDPA: its config names eager attention, the scores written out
    run 70 "$py" -m stratagem verify --model hf:bench/configs/gemma-2-2b-eager --global-batch-size 8 --seq-len 1024 \
        --top 1 --no-compile
    run 120 "$py" bench/trainer_hf.py --accelerator gpu --config bench/configs/phi-2/config.json --batch 4 \
        --seq-len 1024  # compiles each of its 32 layers (Qwen2.5-1.5B's 28: 94 s on 2026-11-28)
}

mechanisms() {
    # most telling first, so that a lease ending early cuts the least: operators without FLOPs by
    # kind against a copy, and by size (a fixed time per kernel, or a lower rate); the compiled
    # steps' time by kernel family; attention by shape; BatchNorm's kernels by shape
    run 50 "$py" bench/reduction_rate.py
    # the misses of 2026-11-28 on an H200: BLOOM-560M's offloaded step by phase with the host link's
    # copy rates, its host optimizer fused now (it ran one tensor at a time at 1.9 ns a parameter
    # where plain tensors took 1.4: page faults on its temporaries are the suspect), with its kernel
    # time and page faults, and the host's optimizer by tensor size against its cache, one tensor at
    # a time and fused, in pinned memory too; then BLOOM's compiled step's kernels (eager attention)
    run 80 "$py" bench/offload_phases.py
    run 60 "$py" bench/host_optimizer_cache.py
    run 60 "$py" bench/gpu_kernels.py hf:bench/configs/bloom-560m:8:1024:compiled
    run 110 "$py" bench/gpu_kernels.py gpt2-large:8:1024:compiled hf:bench/configs/pythia-410m:8:1024:compiled vit-l-16:64::compiled
    run 40 "$py" bench/attention_rate.py
    run 50 "$py" bench/batch_norm_rate.py
}

resnet() {
    # the largest miss recorded (75 ms measured, 59 predicted): where compiled bottlenecks spend it,
    # device or gaps (its blocks recompile with symbolic shapes, which outran 100 s twice)
    run 240 "$py" bench/gpu_kernels.py resnet-101:128::compiled
    # what the advice says channels-last saves, never measured: ResNet-50 eager at 256 images in NCHW
    # and channels-last, one after the other (predicted: an H100 122 and 57.1 ms, 116 measured NCHW;
    # an H200 105 and 41.8)
    run 90 "$py" bench/gpu_kernels.py resnet-50:256 resnet-50:256::channels-last
}

nsight() {
    # the fused (Triton) kernels' bytes as Nsight Compute counts them: replaying all 3,000 of the
    # step's kernels outran 150 s
    run 150 bash -c "ncu --nvtx --nvtx-include measured/ --kernel-name regex:triton \
        --metrics gpu__time_duration.sum,dram__bytes.sum --csv \
        --page raw $py bench/gpu_kernels.py --ncu gpt2-large:8:1024:compiled > $out/kernels-ncu.csv"
    "$py" bench/gpu_kernels.py --summarize "$out/kernels-ncu.csv"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$py" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())'
    # a Hugging Face model's profile follows the installed transformers (Gemma 2 takes SDPA on 4.x,
    # eager attention on 5.x), so the table names it
    "$py" -c 'import transformers; print("transformers", transformers.__version__)' 2>&1 | tail -1
    case $part in
        table) table ;;
        mechanisms) mechanisms ;;
        resnet) resnet ;;
        nsight) nsight ;;
        *) table; mechanisms; resnet; nsight ;;
    esac
} 2>&1 | tee "$out/log-$part"
