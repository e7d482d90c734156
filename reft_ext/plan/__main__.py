"""``python -m reft_ext.plan``: see reft_ext/plan/cli.py and docs/planner.md."""

import sys

from reft_ext.plan.cli import main

sys.exit(main())
