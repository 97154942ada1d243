"""The documentation, the examples, the hostile-input table and the public surface."""
