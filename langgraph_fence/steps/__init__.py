"""Steps: the node and tool wrappers, ``fence_graph``, and the frame a running step reads
(``get_execution_context()``)."""
