"""A policy on Flax models: the one per-module hook for linen and NNX (imports
Flax only when given a Flax object).
"""
