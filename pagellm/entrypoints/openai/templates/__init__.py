"""Chat templates shipped with pagellm, usable by name: ``--chat-template chatml_tools``."""

from __future__ import annotations

from importlib import resources

_SUFFIX = ".jinja"


def shipped_template_names() -> list[str]:
    return sorted(p.name.removesuffix(_SUFFIX) for p in resources.files(__package__).iterdir()
                  if p.name.endswith(_SUFFIX))


def shipped_template(name: str) -> str | None:
    """The text of the shipped template ``name``, or None if there is none by that name."""
    if name not in shipped_template_names():
        return None
    return (resources.files(__package__) / f"{name}{_SUFFIX}").read_text(encoding="utf-8")
