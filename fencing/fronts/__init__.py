"""The fronts over the store: asyncio (:mod:`fencing.asyncio`) and the store cache behind
``service.py``."""
