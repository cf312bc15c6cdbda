"""PyTorch hidden states as a reference, and the twin and port pairs (torch
imported only when called).
"""
