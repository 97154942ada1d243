"""The tools over the library: the ``fencing`` command, the operator's overview, the demo and
the torture harness."""
