"""From a profile, a cluster and a workload to ranked advice.

``enumeration`` yields the candidate plans, ``partition`` balances pipeline stages, ``targets``
says what each runtime can train, ``advice`` costs and ranks the candidates, and ``explain``
says why the winner wins and what would make a model fit.
"""
