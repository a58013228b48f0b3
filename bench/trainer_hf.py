"""A Hugging Face causal LM trained through ``Trainer(strategy="auto-parallel")``: the plan the
strategy chose, its predicted step time and peak memory, against what the run measured.

The model is built from a config with random weights (no download): by default a Qwen2 of
Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, vocabulary 151,936), whose
cross-entropy in ``training_step`` makes the fp32 logits and their gradients the peak; or
(``--shape llama-1b``) a Llama of TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 KV
heads, vocabulary 32,000), or (``--config``) any config.json an ``hf:`` name takes. Tokens are
random. The step time is the median of the steps after ``--warmup``, each timed between
``on_train_batch_start`` and ``on_train_batch_end`` with the device synchronized; the peak is
CUDA's max allocated after the warm-up steps, the warm-up's (compilation included) beside it (on
CPU: not measured). A compiled plan also prints dynamo's graphs and graph breaks in the process.

    python bench/trainer_hf.py --accelerator gpu [--shape llama-1b | --config PATH] [--batch 4] [--seq-len 1024] \
        [--steps 8]
    python bench/trainer_hf.py --tiny                      # a small config, two CPU ranks: a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem.integrations.lightning  # noqa: F401  (registers strategy="auto-parallel")
from stratagem.units import format_bytes, format_seconds
from timing import sync  # bench/timing.py

QWEN2_0_5B = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
              "max_position_embeddings": 4096, "tie_word_embeddings": True}
LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32,
            "num_key_value_heads": 4, "intermediate_size": 5632, "vocab_size": 32000,
            "max_position_embeddings": 2048, "tie_word_embeddings": False}
SHAPES = {"qwen2-0.5b": QWEN2_0_5B, "llama-1b": LLAMA_1B}
TINY = {**QWEN2_0_5B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1024}


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token, in fp32: the training step's loss."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


class CausalLM(pl.LightningModule):
    """``AutoModelForCausalLM`` from ``config``, trained on next-token cross-entropy."""

    def __init__(self, config: dict, batch: int, seq_len: int, warmup: int = 0) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        config = dict(config)
        self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
        self.vocab = self.model.config.vocab_size
        self.example_input_array = torch.randint(0, self.vocab, (batch, seq_len))
        self.times: list[float] = []
        self._started = 0.0
        self.warmup = warmup
        self.warmup_peak: int | None = None  # CUDA's max allocated over the warm-up steps

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return next_token_loss(self(tokens), tokens)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        sync()
        if batch_idx == self.warmup and torch.cuda.is_available():  # the steady steps' peak apart
            self.warmup_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        self._started = time.perf_counter()

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        sync()
        self.times.append(time.perf_counter() - self._started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=None, help="default: 1 GPU, or 2 CPU ranks")
    parser.add_argument("--batch", type=int, default=4, help="samples per rank and step")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--shape", choices=SHAPES, default="qwen2-0.5b", help="the model's shape")
    parser.add_argument("--config", type=Path, help="a Hugging Face config.json instead of --shape's")
    parser.add_argument("--tiny", action="store_true", help="a small config (a smoke run on CPU)")
    args = parser.parse_args()
    devices = args.devices or (1 if args.accelerator == "gpu" else 2)
    seq_len = 32 if args.tiny else args.seq_len
    config = TINY if args.tiny else json.loads(args.config.read_text()) if args.config else SHAPES[args.shape]
    module = CausalLM(config, args.batch, seq_len, args.warmup)
    tokens = torch.randint(0, module.vocab, (args.steps * args.batch * devices, seq_len))
    trainer = pl.Trainer(accelerator=args.accelerator, devices=devices, strategy="auto-parallel",
                         precision="bf16-mixed" if args.accelerator == "gpu" else "32-true",
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=args.batch))
    if trainer.global_rank != 0:
        return
    best = trainer.strategy.advice.best if trainer.strategy.advice is not None else None
    measured = statistics.median(module.times[args.warmup:] or module.times)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    print(f"plan {trainer.strategy.plan.name}: step measured {format_seconds(measured)}"
          + (f", predicted {format_seconds(best.time.step_seconds)} ({best.time.step_seconds / measured - 1:+.0%})"
             if best is not None else ""))
    if peak is not None and best is not None:
        first = f", {format_bytes(module.warmup_peak)} over the warm-up steps" if module.warmup_peak else ""
        print(f"peak allocated {format_bytes(peak)} after the warm-up{first}, predicted "
              f"{format_bytes(best.memory.total)} ({best.memory.total / peak - 1:+.0%})")
    if trainer.strategy.plan.compile:
        from torch._dynamo.utils import counters

        breaks = counters["graph_break"]
        print(f"torch.compile: {counters['stats']['unique_graphs']} graphs, {sum(breaks.values())} graph breaks"
              + (f" (first: {next(iter(breaks))})" if breaks else ""))


if __name__ == "__main__":
    main()
