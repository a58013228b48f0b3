"""What each selective checkpointing policy keeps, as a function of operator names.

One source of truth for the plugin that applies a policy (``torch.utils.checkpoint``'s
``create_selective_checkpoint_contexts``) and the profile that measures what it keeps and
recomputes. Operators are named as torch prints an ``OpOverloadPacket`` (``"aten.mm"``), so this
module needs no torch.

* ``selective``: keep the outputs of the linear layers' matmuls (``mm``, ``addmm``), recompute
  everything else: norms, activations, rotary embedding and the attention core (SDPA included).
* ``selective-op``: torchtitan's op-level policy (``_op_sac_save_list`` with its "every second
  matmul" rule): keep the outputs of the attention kernels and of every odd-numbered matmul
  of the block's forward (the 1st, 3rd, …), recompute the rest. torchtitan counts ``mm`` (and
  ``linear``, which reaches the dispatcher as ``mm``/``addmm`` here); a Linear with a bias
  runs ``addmm``, counted as a matmul too.
"""

from __future__ import annotations

SELECTIVE_POLICIES = ("selective", "selective-op")
"""The ``Plan.activation_checkpointing`` values that keep some operators' outputs."""

MATMUL_OPS = frozenset({"aten.mm", "aten.addmm"})
"""The linear layers' matrix multiplies (``aten.bmm`` is the explicit attention core's)."""

ATTENTION_OPS = frozenset({
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_attention_math",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "aten._scaled_dot_product_flash_attention_for_cpu",  # the CPU kernel the profile and CPU ranks run
})
"""The fused attention kernels SDPA dispatches to (torchtitan saves their outputs)."""

SAVED_OPS = {
    "selective": MATMUL_OPS,
    "selective-op": MATMUL_OPS | ATTENTION_OPS,
}
"""Per policy, the operators whose outputs it may keep (see :func:`keeps_output`)."""


def keeps_output(policy: str, op: str, matmul_index: int) -> bool:
    """Whether ``policy`` keeps the output of operator ``op`` (``"aten.mm"``), where
    ``matmul_index`` is how many matmuls (:data:`MATMUL_OPS`) the block's forward has run so
    far, this one included. ``selective-op`` recomputes every second matmul."""
    if op not in SAVED_OPS[policy]:
        return False
    return not (policy == "selective-op" and op in MATMUL_OPS and matmul_index % 2 == 0)


class PolicyState:
    """One checkpointed block's forward under ``policy``: decides op by op, counting matmuls."""

    def __init__(self, policy: str) -> None:
        if policy not in SAVED_OPS:
            raise ValueError(f"no selective checkpointing policy {policy!r}; known: {', '.join(SAVED_OPS)}")
        self.policy = policy
        self.matmuls = 0

    def keeps(self, op: str) -> bool:
        """Whether the block keeps the output of its next operator, ``op``."""
        if op in MATMUL_OPS:
            self.matmuls += 1
        return keeps_output(self.policy, op, self.matmuls)
