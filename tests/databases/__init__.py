"""What differs between databases: plans, round trips, SQLite's files and write lock, forks,
the private SQLAlchemy names."""
