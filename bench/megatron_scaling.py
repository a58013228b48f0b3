"""Megatron-LM at scale, a public target: the advisor's per-GPU throughput against Narayanan et
al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"),
Table 1, for every row.

    .venv/bin/python bench/megatron_scaling.py

Each row's model is a Megatron-style GPT (LayerNorm, explicit softmax attention, GELU MLP of 4h,
learned positions, tied embeddings, vocabulary 51,200, sequence 2,048), profiled on fake
tensors; the cluster is the paper's DGX A100 nodes (8 × A100-SXM4-80GB, NVSwitch, 8 HDR
InfiniBand NICs each); the workload the row's global batch in fp16 (below: as torch and as
Megatron run it). The plan keeps the paper's tensor- and pipeline-parallel degrees (no sequence
parallelism, which came later), data parallelism without ZeRO and full activation recomputation;
the fastest micro-batch and schedule that fit are the prediction. Throughput counts FLOPs as the
paper does (§5.1, recomputation included): 96·B·s·l·h²·(1 + s/6h + V/16lh) per step.
Target (the issue): mean |error| ≤ 10 %, no row over 20 %.

Two columns, one plan: the fastest that fits as torch runs it. "torch" is the step as torch's
runtime would run it: fp16 autocast over fp32 parameters, and under a pipeline DDP reduces each
stage's gradients inside its last backward, which delays the gradient it sends upstream, so the
drain waits for every stage's reduction in turn. "Megatron" is the same plan as Megatron-LM of the
time ran it (:func:`megatron_seconds`):

- its model in fp16 (``--fp16`` sets ``params_dtype = torch.half``, megatron/arguments.py as of
  April 2021), costed as stratagem's ``fp16-true``: no autocast casts of the weights, which torch
  repeats in every micro-batch's recomputation and for every gradient, and gradients accumulated
  in fp16 over the micro-batches (its DDP's fp32 buffers are opt-in, ``--accumulate-allreduce-
  grads-in-fp32``), where torch adds fp32 gradients; its optimizer's fp32 master copy is left out
  (one step a batch);
- its data-parallel schedule: every stage all-reduces after the flush, at once, unhidden;
- its kernels: the plan's compiled blocks stand for Megatron's fused ones (scale, mask and softmax;
  bias and GeLU; bias, dropout and add; LayerNorm), but Megatron ran the attention probabilities'
  dropout as a kernel of its own after the softmax (megatron/model/transformer.py,
  ``ParallelAttention``, April 2021), which a compiled block fuses into it
  (:func:`attention_dropout_seconds`).

At 530B (pp 35, 280 micro-batches of one sample) Megatron's step is two thirds of torch's. Where no
plan fits as torch runs it, the "Megatron" column costs the plan that comes closest and says how far
over it is: 1T at pp 64 holds 64 micro-batches' block inputs, which autocast keeps in fp32 (the
residual stream adds in the parameters' dtype) where Megatron's fp16 model keeps them in 16 bits.
Megatron's memory is not modelled: the plan is torch's, and where torch's memory rules a schedule
out (the 310B and 530B rows' interleaved stages, over by ×1.03–1.12 as torch holds them), so does
the column.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import torch

from stratagem.advisor.cost.memory import estimate_memory, overflow
from stratagem.advisor.cost.pace import pace
from stratagem.advisor.cost.pipeline import estimate_bubble_seconds
from stratagem.advisor.cost.rates import seconds_per_op_byte
from stratagem.advisor.cost.timing import estimate_time
from stratagem.advisor.hardware import Cluster, parse_cluster
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.advisor.profile.profiler import profile_model
from stratagem.advisor.search.enumeration import search_plans
from stratagem.models import Transformer, TransformerConfig
from stratagem.plan import Plan, Workload

VOCAB, SEQ = 51_200, 2048
# Megatron-LM trains an fp16 model under --fp16 (megatron/arguments.py: params_dtype = torch.half).
MEGATRON_PRECISION = "fp16-true"


class Row(NamedTuple):
    """One row of Table 1: billions of parameters, heads, hidden size, layers, TP, PP, GPUs,
    global batch, achieved TFLOP/s per GPU."""

    params: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float


TABLE_1 = (
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def paper_flops_per_step(row: Row) -> float:
    """FLOPs of one step as the paper counts them (§5.1, eq. 3; full recomputation included)."""
    b, s, l, h = row.batch, SEQ, row.layers, row.hidden
    return 96 * b * s * l * h**2 * (1 + s / (6 * h) + VOCAB / (16 * l * h))


def megatron_gpt(row: Row) -> Transformer:
    """The row's model on the meta device, its output layer tied to the embedding as Megatron's is
    (under a pipeline the last stage keeps a copy and the two gradients are all-reduced, as
    stratagem's pipelines do too)."""
    config = TransformerConfig(vocab_size=VOCAB, dim=row.hidden, n_layers=row.layers, n_heads=row.heads,
                               ffn_dim=4 * row.hidden, max_seq_len=SEQ, attention="explicit",
                               tie_embeddings=True, dropout=0.1)
    with torch.device("meta"):
        return Transformer(config)


class Prediction(NamedTuple):
    torch: float  # TFLOP/s per GPU as torch's runtime would run the plan (nan: nothing fits)
    megatron: float  # the same plan as Megatron-LM ran it: its fp16 model and data-parallel schedule
    plan: str
    overflow: float  # the plan's memory over the usable, where nothing fits (1 where it fits)


def predict(row: Row) -> Prediction:
    """The advisor's TFLOP/s per GPU for the row, as torch runs the fastest plan of the row's shape
    that fits and as Megatron-LM would run that plan (:func:`megatron_seconds`); where none fits,
    the smallest plan's, marked by how far over memory it is."""
    profile, cluster, workload = costing(row, "fp16-mixed")
    fitting, smallest = [], None
    # Megatron's data parallelism is DDP beside TP, which stratagem's own runtime leaves out
    # (its DDP takes no DTensors): cost every plan of the row's shape, whatever runs it.
    for group in search_plans(profile, cluster, workload):
        for plan in group:
            if (plan.tp, plan.pp, plan.zero, plan.sequence_parallel, plan.activation_checkpointing) != (
                    row.tp, row.pp, 0, False, "full"):
                break  # a group shares all five
            over = overflow(estimate_memory(profile, workload, plan), cluster)
            costed = (estimate_time(profile, cluster=cluster, workload=workload, plan=plan).step_seconds, over, plan)
            smallest = min(smallest or costed, costed, key=lambda c: (c[1], c[0]))
            if over > 1:
                break  # larger micro-batches need more memory still
            fitting.append(costed)
    torch_seconds, over, plan = min(fitting, key=lambda c: c[0]) if fitting else smallest
    flops = paper_flops_per_step(row) / row.gpus / 1e12
    return Prediction(flops / torch_seconds if fitting else float("nan"), flops / megatron_seconds(row, plan),
                      plan.name, over)


def costing(row: Row, precision: str) -> tuple[ModelProfile, Cluster, Workload]:
    """The row's model profiled in ``precision``, its cluster and its workload."""
    tokens = torch.zeros(2, SEQ, dtype=torch.long, device="meta")
    profile = profile_model(megatron_gpt(row), (tokens,), precision=precision, name=f"gpt-{row.params}B")
    cluster = parse_cluster(f"{row.gpus // 8}x8xA100-SXM4-80GB:ib-hdr")
    return profile, cluster, Workload(global_batch_size=row.batch, seq_len=SEQ, precision=precision)


def megatron_seconds(row: Row, plan: Plan) -> float:
    """The step of ``plan`` as Megatron-LM (2021) runs it. Its fp16 model: the plan in
    ``fp16-true`` (no autocast casts, gradients accumulated in fp16). Its data-parallel schedule
    under a pipeline: every stage all-reduces its gradients after the flush, at once and unhidden
    (its ``allreduce_gradients`` after the schedule), where torch's pipelining runs DDP's
    reductions inside each stage's last backward, which delays the gradient it sends upstream, so
    the drain waits for each stage's in turn (docs/cost-model.md, "Pipeline"). Without a pipeline
    both overlap alike."""
    profile, cluster, workload = costing(row, MEGATRON_PRECISION)
    plan = dataclasses.replace(plan, precision=MEGATRON_PRECISION)
    time = estimate_time(profile, cluster=cluster, workload=workload, plan=plan)
    paced = pace(profile, cluster=cluster, workload=workload, plan=plan)
    # the dropout's kernels in each micro-batch of the paced rank, and in its bubble's share of them
    dropout = attention_dropout_seconds(row, plan, cluster, layers=len(paced.step.stage.blocks)) * (
        plan.microbatches * plan.grad_accum + (paced.others_share / plan.pp_virtual if plan.pp > 1 else 0.0))
    if plan.pp == 1:
        return time.step_seconds + dropout
    fill = estimate_bubble_seconds(paced, reductions=0.0)
    return time.step_seconds - time.bubble + fill - time.dp_comm + time.dp_comm_total + dropout


# Bytes per attention probability that Megatron's dropout kernel moves beyond a compiled block's
# kernels (fp16 values, one-byte masks). Its forward reads the softmax's output (2) and writes
# its own (2) and the mask (1), where the compiled block's softmax kernel writes the dropped
# output in place of the softmax's and the mask with it (1, as the profile counts it): 4 more,
# twice under full recomputation. Its backward reads the gradient (2) and the mask (1) and writes
# the softmax's input gradient (2), where the compiled block's kernel reads the mask (1) beside
# what it reads anyway: 4 more.
DROPOUT_BYTES_PER_PROBABILITY = 2 * 4 + 4


def attention_dropout_seconds(row: Row, plan: Plan, cluster: Cluster, *, layers: int) -> float:
    """Seconds one micro-batch of ``plan`` spends on ``layers`` layers in Megatron's
    attention-dropout kernels beyond a compiled block's: :data:`DROPOUT_BYTES_PER_PROBABILITY` for
    each of its ``heads / tp × s²`` probabilities a layer, at the cluster's cost per byte moved."""
    probabilities = plan.micro_batch_size * row.heads // row.tp * SEQ**2 * layers
    return probabilities * DROPOUT_BYTES_PER_PROBABILITY * seconds_per_op_byte(cluster)


def main() -> None:
    started = time.perf_counter()
    print(f"{'params':>7} {'TP':>2} {'PP':>2} {'GPUs':>5} {'batch':>5} {'paper':>6} {'torch':>6} {'error':>6} "
          f"{'Megatron':>8} {'error':>6}  plan")
    torch_errors, megatron_errors = [], []
    for row in TABLE_1:
        p = predict(row)
        torch_errors.append(abs(p.torch / row.tflops - 1))
        megatron_errors.append(abs(p.megatron / row.tflops - 1))
        over = f" (over memory ×{p.overflow:.2f} as torch runs it)" if p.overflow > 1 else ""
        print(f"{row.params:>6.1f}B {row.tp:>2} {row.pp:>2} {row.gpus:>5} {row.batch:>5} {row.tflops:>6.0f} "
              f"{p.torch:>6.1f} {p.torch / row.tflops - 1:>+6.0%} {p.megatron:>8.1f} {p.megatron / row.tflops - 1:>+6.0%}"
              f"  {p.plan}{over}")
    for label, errors in (("torch's runtime", torch_errors), ("Megatron-LM's runtime", megatron_errors)):
        known = [e for e in errors if e == e]
        print(f"{label}: mean |error| {sum(known) / len(known):.1%}, worst {max(known):.1%} over {len(known)} rows"
              + (f"; {len(errors) - len(known)} fit nowhere" if len(known) < len(errors) else ""))
    print(f"target: mean ≤ 10 %, no row over 20 %; {time.perf_counter() - started:.0f} s")
    print(block_traffic(TABLE_1[0]))


def block_traffic(row: Row) -> str:
    """What one block of ``row``'s model moves without FLOPs at 2 × 2,048 tokens, eager and compiled
    (the fused count: docs/cost-model.md, compiled blocks), with the kernels each launches."""
    tokens = torch.zeros(2, SEQ, dtype=torch.long, device="meta")
    block = profile_model(megatron_gpt(row), (tokens,), precision="fp16-mixed").blocks[0]
    return (f"{row.params}B, one block at 2 × {SEQ} tokens: forward {block.fwd_op_bytes / 1e9:.1f} GB in "
            f"{block.fwd_ops} operators eager, {block.fwd_fused_op_bytes / 1e9:.1f} GB in {block.fwd_fused_ops} "
            f"kernels compiled; backward {block.bwd_op_bytes / 1e9:.1f} GB in {block.bwd_ops}, "
            f"{block.bwd_fused_op_bytes / 1e9:.1f} GB in {block.bwd_fused_ops}")


if __name__ == "__main__":
    main()
