"""Built-in models for the divergence checker, in Flax NNX and linen (imports Flax)."""
