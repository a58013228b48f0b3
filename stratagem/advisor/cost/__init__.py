"""The cost models: per-rank memory and step time of one Plan, term by term.

``memory`` sums model states, activations and buffers on the fullest rank; ``timing`` the
step's compute, communication, pipeline, host and optimizer terms on the rank that paces it
(``pace``); ``collectives`` prices one collective on the link a mesh axis crosses; ``stages`` is
a profile summed per pipeline rank; ``estimate`` holds the breakdowns and ``evaluate`` runs a
plan through both models.
"""
