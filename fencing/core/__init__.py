"""The core: plain values, errors, argument checks, the clock in SQL, and where sync meets asyncio.

Imports nothing else of the library."""
