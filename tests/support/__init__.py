"""What more than one test module uses, in one place: no test module imports another.

- :mod:`tests.support.databases`: the backends, PostgreSQL schemas, engines, tables;
- :mod:`tests.support.polling`: ``eventually()``, the one way to wait without being told;
- :mod:`tests.support.processes`: starting, signalling and reaping a test's processes;
- :mod:`tests.support.pg_cluster`: a private PostgreSQL cluster a test may stop and kill;
- :mod:`tests.support.statements`: counting the SQL statements a piece of code sends;
- :mod:`tests.support.agents`: a scripted chat model for the LangChain agents;
- :mod:`tests.support.clocks`: a controlled clock a test steps, settling after each step;
- :mod:`tests.support.serving`: ``serving()``, ``opened()``, ``cfg()``, lease-status waits;
- helpers of one family of tests each, used by more than one module:
  :mod:`~tests.support.children`, :mod:`~tests.support.quickstart`,
  :mod:`~tests.support.hardening`, :mod:`~tests.support.cli`,
  :mod:`~tests.support.fault_points`, :mod:`~tests.support.stalls`,
  :mod:`~tests.support.tables`, :mod:`~tests.support.leases`, :mod:`~tests.support.sinks`,
  :mod:`~tests.support.chaos_serve`;
- the worker scripts and graph factories the chaos tests start as processes
  (``python -m tests.support.write_steps`` and the like, ``--graphs
  tests.support.chaos_graphs:FUNCTION``): :mod:`~tests.support.write_steps`,
  :mod:`~tests.support.chaos_graphs`, :mod:`~tests.support.approvals`,
  :mod:`~tests.support.store_worker`, :mod:`~tests.support.fork_worker`,
  :mod:`~tests.support.children_graphs`.

``tests/test_layout.py`` keeps it so: a test module or ``conftest.py`` importing anything
under ``tests.`` but ``tests.support`` fails there, named with its line.
"""
