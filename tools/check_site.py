"""Check a built documentation site (``nox -s docs`` runs it after ``mkdocs build --strict``).

``python tools/check_site.py SITE_DIR`` exits 1, naming each page, when the site fetches
anything from the web when read (it must read offline: no web fonts, no CDN), when a
docstring's Sphinx role is shown raw (``docs/hooks/rst_roles.py`` shows them as the code they
name), when reST's ``::`` shows in a page's text (the docstrings end a paragraph before a
code block with ``:``), when the API reference lists a class's bases (private mixins;
``show_bases`` is off in mkdocs.yml, on for the errors' hierarchy only), or when a page with a
code block links no stylesheet that wraps its long lines (``docs/stylesheets/``).
Standard library only: it runs in any session's python.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: a docstring's Sphinx role as Markdown renders it: the role's name before the code, or its
#: target's ``~`` (Sphinx's "show the last name") left in the code
RAW_ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj):<code>|<code>~[\w.]+</code>")

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


#: reST's literal-block marker as Markdown leaves it: ``::`` ending a word of the text
RAW_LITERAL = re.compile(r"\S::(?=\s|$)")
#: what a browser does not show as the page's text: code, scripts, styles, then every tag
NOT_TEXT = re.compile(r"<(pre|code|script|style)\b.*?</\1\s*>", re.S | re.I)
TAG = re.compile(r"<[^>]+>")
#: a page's stylesheets, and a rule of one that wraps a code block's lines
STYLESHEET = re.compile(r"""<link\b[^>]*\brel=["']?stylesheet["']?[^>]*\bhref=["']?([^"'\s>]+)""", re.I)
WRAPS = re.compile(r"\bpre\b[^{}]*\bcode\b[^{}]*\{[^}]*white-space:\s*pre-wrap", re.I)


def text_of(html: str) -> str:
    """A page's text outside its code, as a reader sees it (tags dropped)."""
    return TAG.sub(" ", NOT_TEXT.sub(" ", html))


def raw_literals(site: Path) -> list[str]:
    """Each place a page's text shows reST's ``::`` (a docstring's paragraph before its code)."""
    found = []
    for page in sorted(site.rglob("*.html")):
        text = text_of(page.read_text(encoding="utf-8"))
        for m in RAW_LITERAL.finditer(text):
            shown = " ".join(text[max(0, m.start() - 60) : m.end()].split())
            found.append(f"{page.relative_to(site)}: ...{shown}")
    return found


#: the API reference's page; the errors' page shows their bases (the hierarchy to catch)
API_PAGE = Path("reference", "api", "index.html")


def bases_shown(site: Path) -> list[str]:
    """The classes of the API reference whose bases it lists (private mixins, mostly)."""
    html = (site / API_PAGE).read_text(encoding="utf-8")
    return [" ".join(TAG.sub("", m.group(0)).split()) for m in re.finditer(r"Bases:.*?</p>", html, re.S)]


def wrapping_stylesheets(site: Path, page: Path) -> list[str]:
    """The site's own stylesheets ``page`` links that wrap a code block's long lines."""
    root = site.resolve()
    sheets = [
        (page.parent / href.split("?")[0]).resolve()
        for href in STYLESHEET.findall(page.read_text(encoding="utf-8"))
    ]
    return [
        str(sheet.relative_to(root))
        for sheet in sheets
        if sheet.is_relative_to(root)
        and sheet.is_file()
        and WRAPS.search(sheet.read_text(encoding="utf-8", errors="replace"))
    ]


def clipped_code(site: Path) -> list[str]:
    """The pages with a code block that link no stylesheet wrapping its lines."""
    return [
        str(page.relative_to(site))
        for page in sorted(site.rglob("*.html"))
        if "<pre" in page.read_text(encoding="utf-8") and not wrapping_stylesheets(site, page)
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
    if literals := raw_literals(site):
        shown = "\n".join(literals)
        print(f"reST's :: shown raw (end the paragraph with ':'):\n{shown}", file=sys.stderr)
        return 1
    if bases := bases_shown(site):
        shown = "\n".join(bases)
        print(f"{API_PAGE} lists bases (show_bases: false in mkdocs.yml):\n{shown}", file=sys.stderr)
        return 1
    if clipped := clipped_code(site):
        print(f"code blocks clipped, no wrapping stylesheet, on: {', '.join(clipped)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} SITE_DIR")
    sys.exit(main(Path(sys.argv[1])))
