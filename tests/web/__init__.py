"""The dashboard and the lease API over HTTP."""
