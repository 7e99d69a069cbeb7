"""MkDocs hook: the site shows README.md, BENCHMARKS.md and CONTRIBUTING.md (which live at the
repository root, outside ``docs/``) as pages, and keeps every relative link working on both GitHub
and the site.

* ``docs/index.md``, ``docs/benchmarks/index.md`` and ``docs/contributing.md`` are placeholders: their
  page shows the root file instead (:data:`ROOT_PAGES`).
* In every page, a relative link is resolved from the file's real place in the repository; a link
  to one of the root files becomes a link to its page, and a link into ``docs/`` is made relative
  to the page. Links that leave ``docs/`` otherwise are left alone, so ``mkdocs build --strict``
  reports them.
* A source citation such as ``[v1]`` right after a closing bracket (``[-10, 10] [o2]``,
  ``[v1][v2]``) would be read as a reference link to an undefined target; its bracket is escaped.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOT_PAGES = {"index.md": "README.md", "benchmarks/index.md": "BENCHMARKS.md", "contributing.md": "CONTRIBUTING.md"}
_PAGE_OF_ROOT_FILE = {root: page for page, root in ROOT_PAGES.items()}
_LINK = re.compile(r"(\]\()([^)\s]+)(\))")
_CITATION_AFTER_BRACKET = re.compile(r"(\] ?)(\[[a-z]\d+\])")


def _rewrite(target: str, source: str, page: str) -> str:
    """``target`` as written in ``source`` (a path from the repository root), seen from ``page`` (a path in docs/)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return target
    path, _, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
    if resolved in _PAGE_OF_ROOT_FILE:
        in_docs = _PAGE_OF_ROOT_FILE[resolved]
    elif resolved.startswith("docs/"):
        in_docs = resolved[len("docs/") :]
    else:
        return target
    rel = posixpath.relpath(in_docs, posixpath.dirname(page) or ".")
    return rel + ("#" + anchor if anchor else "")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001, ARG001 (MkDocs' hook signature)
    page_path = page.file.src_uri
    source = ROOT_PAGES.get(page_path)
    if source is not None:
        markdown = (ROOT / source).read_text()
    else:
        source = "docs/" + page_path
    markdown = _CITATION_AFTER_BRACKET.sub(lambda m: m.group(1) + "\\" + m.group(2), markdown)
    return _LINK.sub(lambda m: m.group(1) + _rewrite(m.group(2), source, page_path) + m.group(3), markdown)
