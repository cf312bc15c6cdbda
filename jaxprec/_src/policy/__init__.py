"""Policies as data: ``Rule``, ``Policy`` and their one text grammar. Never
imports Flax.
"""
