"""Policy search: the switched program that runs every candidate policy in
one compiled program (``switch``), the search itself (``search``,
``search_algorithm``, ``search_dtype``) and its result (``search_result``).
"""
