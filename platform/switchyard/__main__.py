"""``python -m switchyard`` is the ``switchyard`` command."""

from switchyard.cli import main

if __name__ == "__main__":  # not when a worker process re-runs the parent's main module (anyio.to_process)
    main()
