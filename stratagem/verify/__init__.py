"""Verification: run the advisor's plans for a few steps on this host and measure them.

Imports the advisor and the plugins (like :mod:`stratagem.integrations`); nothing in the
advisor or the plugins imports it.
"""

from stratagem.verify.runner import Measured
from stratagem.verify.verify import Verified, measured_winner, too_close_to_call, verify_estimates, verify_plan

__all__ = ["Measured", "Verified", "measured_winner", "too_close_to_call", "verify_estimates", "verify_plan"]
