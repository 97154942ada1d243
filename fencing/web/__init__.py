"""The web face (the ``web`` extra): a dashboard an application mounts, and a lease API over HTTP.

* :func:`dashboard`: what the jobs are doing, who holds them, what was refused; live.
* :func:`lease_api`: claim, renew, complete, release and read jobs over HTTP, for workers
  in any language, with the same fencing.
* :func:`bearer_tokens`: an ``authorize`` callable for either, from a table of tokens;
  :class:`Caller`: who is asking and the owners it may act as in the lease API.
"""

from __future__ import annotations

from .api import lease_api
from .auth import Authorize, Caller, bearer_tokens
from .pages import dashboard

__all__ = ["Authorize", "Caller", "bearer_tokens", "dashboard", "lease_api"]
