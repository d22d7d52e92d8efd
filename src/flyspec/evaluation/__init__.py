"""Accuracy recovery on real tasks and the speed/accuracy trade-off of FLy (``flyspec eval``).

Runs HumanEval (pass@1, code executed in :mod:`flyspec.evaluation.sandbox`) and GSM8K (final
number) with the target alone, exact SPD and FLy at one or several settings on the same
problems, and reports score with Wilson intervals, recovery against the target, speedup,
tau and every problem whose outcome changed. Generations are cached on disk.

Modules: ``run`` (one evaluation, :func:`~flyspec.evaluation.run.run_evaluation`), ``tasks``
(prompts, extraction, scoring), ``sandbox``, ``cache``, ``runner``, ``report``,
``loosening`` (what loosely kept tokens did).
"""
