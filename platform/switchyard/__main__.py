"""``python -m switchyard`` is the ``switchyard`` command."""

from switchyard.cli import main

main()
