"""The SQL layer: the tables, every statement built once with Core, and how database errors
cross into the library. Imports only :mod:`fencing.core`."""
