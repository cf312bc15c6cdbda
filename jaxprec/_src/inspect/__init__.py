"""Reading a program without running it: ``audit``, ``cost`` and the chip
table, ``explain``.
"""
