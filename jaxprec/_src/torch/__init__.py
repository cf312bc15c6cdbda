"""PyTorch: reading PyTorch hidden states as a reference (``torch_ref``), the
Hugging Face Flax twins (``torch_twins``) and the port checks against
PyTorch originals (``torch_ports``). Imports torch and transformers only
when called.
"""
