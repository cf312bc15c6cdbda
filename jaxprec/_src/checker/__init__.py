"""The divergence checker: layer naming (``layers``), references
(``reference``), how a row runs (``rows``), the jitted programs
(``harness``), on-device statistics and host metrics (``metrics``), reports
and their rendering (``report``, ``render``), and its clients
:func:`jaxprec.check`, ``check_module`` (which captures submodule outputs),
``check_training`` and the pytest assertion ``assert_precision_robust``.
"""
