"""Private: the store and everything built on its leases. The operations (leases, batches,
fenced blocks), ownership history, fence marks, the lease rules and their keepers (a thread, a
task), named locks and elections, and the engines cached for ``service.py``."""
