"""Adapters for the frameworks users already run (Lightning, Accelerate, DeepSpeed)."""
