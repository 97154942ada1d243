"""A MkDocs hook: the docstrings' Sphinx roles (``:class:`Lease```) read as plain code.

The docstrings are reST-flavoured prose that mkdocstrings shows as written
(``docstring_style: null``), where Markdown renders ``:meth:`claim``` as the text ``:meth:``
before the code ``claim``. This drops the role's name in front of the code, so the reader
sees ``claim`` alone, as the source's reader does. A target written ``~fencing.JobStore.renew``
is shown as Sphinx shows it, by its last name (``renew``). Roles not followed by code are left
as they are (the build keeps them visible, so a new shape shows up).
"""

from __future__ import annotations

import re
from typing import Any

#: a role's name right before the code Markdown made of its target, and that target
ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj|ref|const):<code>(~?)([^<]*)</code>")


def shown(role: re.Match[str]) -> str:
    shortened, target = role.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if shortened else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    return ROLE.sub(shown, html)
