"""The divergence checker: ``check``, ``check_module``, ``check_training`` and
``assert_precision_robust`` (docs/architecture.md lists the modules).
"""
