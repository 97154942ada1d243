"""The ``fencing`` command."""
