"""Policy search: the switched program, the search and its result."""
