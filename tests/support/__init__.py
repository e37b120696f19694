"""What more than one test module uses, in one place: no test module imports another.

- :mod:`tests.support.databases`: the backends, PostgreSQL schemas, engines, tables;
- :mod:`tests.support.polling`: ``eventually()``, the one way to wait without being told;
- :mod:`tests.support.processes`: starting, signalling and reaping a test's processes;
- :mod:`tests.support.pg_cluster`: a private PostgreSQL cluster a test may stop and kill;
- :mod:`tests.support.statements`: counting the SQL statements a piece of code sends;
- :mod:`tests.support.agents`: a scripted chat model for the LangChain agents;
- the worker scripts and graph factories the chaos tests start as processes
  (``python -m tests.support.write_steps`` and the like, ``--graphs
  tests.support.chaos_graphs:FUNCTION``): :mod:`~tests.support.write_steps`,
  :mod:`~tests.support.chaos_graphs`, :mod:`~tests.support.approvals`,
  :mod:`~tests.support.store_worker`, :mod:`~tests.support.fork_worker`,
  :mod:`~tests.support.children_graphs`.

``tests/test_layout.py`` keeps it so: a test module or ``conftest.py`` importing anything
under ``tests.`` but ``tests.support`` fails there, named with its line.
"""
