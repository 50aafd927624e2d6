"""``python -m remotorch``: the command line (:func:`remotorch.cli.main`)."""

try:
    from .cli import main

    status = main()
except KeyboardInterrupt:  # Ctrl-C while the command line itself loads (main answers it after that)
    status = 130
raise SystemExit(status)
