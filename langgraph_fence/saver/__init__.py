"""The saver side above any saver: the fenced checkpointer and store wrappers, and admin
operations on a thread under its execution's lease (erasure included)."""
