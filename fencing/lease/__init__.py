"""Lease keepers: the rules a heartbeat follows (:mod:`.rules`), carried out by a thread
(:mod:`.thread`) or by an asyncio task (:mod:`.task`)."""
