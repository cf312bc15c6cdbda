"""Names and facts: precision spellings, the one table of algorithms, the flag
in force. Never imports Flax.
"""
