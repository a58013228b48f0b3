"""Pure planning: profile the model, describe the cluster, cost and rank plans.

Nothing here needs a process group (calibration benchmarks aside), and nothing here imports
``stratagem.plugins`` or ``stratagem.integrations``.
"""
