"""Optimal-transport toolkit for aligning neurons of two layers (see docs/ot.md).

cost.py (ground costs), sinkhorn.py (our stabilised entropic solver), assignment.py (exact plan),
official.py (the released code's POT call), plan.py (a solved plan and how it is applied),
stats.py (entropy, permutation closeness, marginal errors), solve.py (front door).
"""

from otdus_cli.transport.plan import TransportPlan
from otdus_cli.transport.solve import match_rows, solve_cost

__all__ = ["TransportPlan", "match_rows", "solve_cost"]
