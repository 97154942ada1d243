"""The runtime: how a unit of work reaches the database (executors and the runner), and the
holds that keep fenced blocks and heartbeats of one process from waiting for each other."""
