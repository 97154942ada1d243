"""Check a built documentation site (``nox -s docs`` runs it after ``mkdocs build --strict``).

``python tools/check_site.py SITE_DIR`` exits 1, naming each page, when the site fetches
anything from the web when read (it must read offline: no web fonts, no CDN), or when a
docstring's Sphinx role is shown raw (``docs/hooks/rst_roles.py`` shows them as the code they
name). Standard library only: it runs in any session's python.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: a docstring's Sphinx role as Markdown renders it: the role's name before the code
RAW_ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj):<code>")

#: what a browser fetches by itself when a page is read (a script, a stylesheet, a font, an
#: image, a preconnect), as opposed to a link the reader may follow. (Material's script names
#: two URLs it loads only on demand: a ResizeObserver polyfill for browsers without one, and
#: mermaid for a page with a diagram; no page has one.)
FETCHED = re.compile(
    r"""<(?:script|img|iframe|source)\b[^>]*\bsrc=["']?(?:https?:)?//[^"'\s>]+"""
    r"""|<link\b[^>]*\bhref=["']?(?:https?:)?//[^"'\s>]+"""
    r"""|@import\s+(?:url\()?["']?(?:https?:)?//[^"')\s]+"""
    r"""|url\(\s*["']?(?:https?:)?//[^"')\s]+""",
    re.I,
)


def fetched_from_the_web(site: Path) -> list[str]:
    """Every reference in the built site that a browser would fetch from another host."""
    found = []
    for path in sorted(site.rglob("*")):
        if path.suffix in (".html", ".css", ".js") and path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            found += [f"{path.relative_to(site)}: {m.group(0)[:160]}" for m in FETCHED.finditer(text)]
    return found


def raw_roles(site: Path) -> list[str]:
    """The pages that show a Sphinx role raw."""
    return [
        str(page.relative_to(site))
        for page in sorted(site.rglob("*.html"))
        if RAW_ROLE.search(page.read_text(encoding="utf-8"))
    ]


def main(site: Path) -> int:
    if fetched := fetched_from_the_web(site):
        shown = "\n".join(fetched)
        print(f"the site fetches from the web when read (it must read offline):\n{shown}", file=sys.stderr)
        return 1
    print(f"offline: no page, stylesheet or script of the site fetches from the web ({site})")
    if roles := raw_roles(site):
        print(f"Sphinx roles shown raw on: {', '.join(roles)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} SITE_DIR")
    sys.exit(main(Path(sys.argv[1])))
