"""What an operator reads: the read-only queries the CLI and the dashboard share."""
