"""A run's life under its lease: start, keep (renewal and watchdog), settle and release;
its children; and the worker loop that takes executions over."""
