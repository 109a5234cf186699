"""Console pages, one module per page; each exports ``ROUTES`` (mounted under ``/admin`` behind the
session guard, see :mod:`switchyard.admin.console`)."""
