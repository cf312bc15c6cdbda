"""PyTorch: its hidden states as a reference (``torch_ref``), and the twin
and port pairs with JAX models (``torch_ports``). Imports torch and
transformers only when called.
"""
