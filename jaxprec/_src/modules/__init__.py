"""Flax modules and the Flax side of precision policies (imports Flax)."""
