"""Built-in models for the divergence checker (flax.linen; imports flax)."""
