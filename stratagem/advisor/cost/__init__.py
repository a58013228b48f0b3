"""The cost models: per-rank memory and step time of one Plan, term by term.

``memory`` sums model states, activations and buffers on the most loaded rank; ``timing`` the
step's compute, communication, pipeline, host and optimizer terms; ``collectives`` prices one
collective on the link a mesh axis crosses; ``stages`` is a profile summed per pipeline rank;
``estimate`` holds the breakdowns and ``evaluate`` runs a plan through both models.
"""
