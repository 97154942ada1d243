"""Named locks and leader election."""
