"""Private: how a unit of work reaches the database. The runner and its executors, what the
library needs of the application's engine (admission, checkout, what survives ``fork()``, the
SQLite glue with its write lock), the holds between fenced blocks and heartbeats, where sync
meets asyncio, and the counters and log lines every path reports to."""
