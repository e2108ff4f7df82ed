"""``python -m jagg_pipeline``: the command line, one command per process."""

from jagg_pipeline.support import lifetime, startup

# First: the start-up is measured from here where /proc cannot say, and collected less often.
startup.start_command()
lifetime.die_with_launcher()

from jagg_pipeline.cli import main  # noqa: E402

status = main()
startup.end_command()
raise SystemExit(status)
