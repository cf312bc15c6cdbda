"""Policies as data: ``Rule``, ``Policy`` (a precision and a compute dtype per
module path, type and op kind) and their one text grammar (``policy_text``).

Imports only the packages below it; never Flax.
"""
