"""``python -m jagg_pipeline``: the command line."""

from jagg_pipeline.cli import main

raise SystemExit(main())
