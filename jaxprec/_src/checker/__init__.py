"""The divergence checker: layer naming and capture (``layers``, ``capture``),
references (``reference``), how a row runs (``rows``), the jitted programs
(``harness``), on-device statistics and host metrics
(``metrics``), reports and their rendering (``report``,
``training_report``, ``render``), and its clients
:func:`jaxprec.check`, ``check_module``, ``check_training`` and the pytest
assertion ``assert_precision_robust``.
"""
