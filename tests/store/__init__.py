"""The store's operations and their guarantees, on both fronts."""
