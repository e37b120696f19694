"""``python -m langgraph_fence.cli``: the ``langgraph-fence`` command."""

import sys

from . import main

sys.exit(main())
