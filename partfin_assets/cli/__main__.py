"""`python -m partfin_assets.cli`: the `partfin` command."""

from partfin_assets.cli import main

raise SystemExit(main())
