"""``python -m langgraph_fence``: the ``langgraph-fence`` command, run by this interpreter
(no activated virtual environment needed)."""

import sys

from .cli import main

sys.exit(main())
