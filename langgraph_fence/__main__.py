"""``python -m langgraph_fence``: the ``langgraph-fence`` command, run by this interpreter
(no activated virtual environment needed)."""

import sys

from langgraph_fence.cli import main

sys.exit(main())
