"""Engine glue: what the library needs of the application's engine (admission), the pool
checkout, what survives ``fork()``, and the SQLite glue with its write lock."""
