"""``python -m stratagem`` runs the command line."""

from stratagem.cli import main

raise SystemExit(main())
