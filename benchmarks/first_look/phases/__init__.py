"""One module per phase of the run, each making that phase's rows: ``bandwidth``, ``model``
(in ``models.py``), ``same_tokens``, ``forward_cost``, ``engine`` (engine alone), ``profile``,
``loop_overhead``, ``projection``, ``kernel_check``, ``attention``, ``compiled``, ``replay``,
and the two tables that close a run, ``compiles`` and ``goals``."""
