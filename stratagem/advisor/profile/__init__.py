"""What a model costs, per block, measured on fake tensors.

``profiler`` runs one training step on ``FakeTensorMode`` (``measure`` counts FLOPs, bytes and
operators per segment); ``structure`` finds the blocks, ``tp_layout`` how tensor parallelism
splits them; ``sources`` turns a preset name, a factory or a Hugging Face config into a module;
``cache`` keeps profiles on disk by everything they depend on; ``model_profile`` is the data
the cost models read. Only ``model_profile`` and ``cache`` import without torch.
"""
