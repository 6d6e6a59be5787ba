"""`python -m parallax_ng ...`: the `parallax-ng` command."""
from .tools.cli import main

raise SystemExit(main())
