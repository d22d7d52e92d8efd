"""Test oracles: what flyspec's rule decides, stated independently of any engine, for the
tests and for ``benchmarks/vllm_fly_gpu.py`` to check engines against. Runtime code never
imports this package."""
