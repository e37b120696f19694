"""``python -m langgraph_fence.cli``: the ``langgraph-fence`` command."""

import sys

from langgraph_fence.cli import main

sys.exit(main())
