"""The application: ``python -m labkit`` (``cli``), training runs with checkpoints and resume
(``train``, ``checkpoint``), and recording the results and notebooks (``record``)."""
