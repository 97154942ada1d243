"""Processes killed, servers crashed, connections cut: the guarantee under faults."""
