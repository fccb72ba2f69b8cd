"""``python -m verl_partial.sim``: the same as ``verl-partial simulate``."""

import sys

from verl_partial.sim.cli import main

sys.exit(main())
