"""Group-preserving batch balancing, and the transition plan for ``balance.rows=transition``."""
