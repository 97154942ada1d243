"""Private: the tables, the statements built on them, argument checks, plain values, the clock
in SQL and the database errors' classification. Imports nothing else of the library but
:mod:`fencing._errors`."""
