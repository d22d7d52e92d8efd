"""Test oracles: what flyspec's rule decides, stated independently of any engine, for the
tests and for ``benchmarks/vllm_fly_gpu.py`` to check engines against; and the counter of
host reads (:mod:`flyspec.testing.host_reads`) that the tests and ``benchmarks/host_reads.py``
count a round's synchronisations with. Runtime code never imports this package."""
