"""Measuring: the ladder's harness (``bench``), host reads by call site (``syncmeter``), the
profiler's view (``profiling``), the kernels compiled regions launch (``kernels``) and the envs
alone (``envbench``). They run the ladder and never change it."""
