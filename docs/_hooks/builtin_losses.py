"""MkDocs hook: the list of the built-in policy losses on the site is written from the code.

Where a page has ``<!-- builtin-losses -->...<!-- /builtin-losses -->`` (the ``policy`` row of
docs/compose.md's table of parts), the site shows, in place of the text between the markers (which is
what GitHub shows), every class of :data:`fnppo.core.losses.builtins.BUILTIN_LOSSES` by name, in its
order: the default of ``LossConfig.policy`` marked as such, the families of :data:`FAMILY_NOTES`
after the others, each after its note. A new loss is listed without an edit here or in the page.
"""

from __future__ import annotations

import re

MARKERS = re.compile(r"<!-- builtin-losses -->.*?<!-- /builtin-losses -->", re.S)
FAMILY_NOTES = {"fnppo.core.losses.offpolicy": "for stale rollouts"}
"""Family module -> the words before its losses (a family not named here leads the list, unnamed)."""


def loss_list() -> str:
    """The built-in losses as the page shows them: ```ppo_clip` (default, dual clip 3.0), `gspo`, ...;
    for stale rollouts `dppo_tv`, ...``."""
    from fnppo.core.losses.builtins import BUILTIN_LOSSES
    from fnppo.core.losses.config import LossConfig

    default = LossConfig().policy
    groups: dict[str, list[str]] = {}
    for cls in BUILTIN_LOSSES:
        name = f"`{cls.__name__}`"
        if type(default) is cls:
            dual_clip = getattr(default, "dual_clip", None)
            name += " (default" + ("" if dual_clip is None else f", dual clip {dual_clip}") + ")"
        groups.setdefault(FAMILY_NOTES.get(cls.__module__, ""), []).append(name)
    lead = groups.pop("", [])
    parts = [", ".join(lead)] if lead else []
    parts += [f"{note} {', '.join(names)}" for note, names in groups.items()]
    return "; ".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001, ARG001 (MkDocs' hook signature)
    if "<!-- builtin-losses -->" not in markdown:
        return markdown
    listed = loss_list()
    return MARKERS.sub(lambda _: listed, markdown)
