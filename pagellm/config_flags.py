"""Command-line flags generated from a dataclass's fields, so each option is defined once.

A field made with ``option(default, help, ...)`` carries an ``Opt`` in its metadata: help text,
choices, the flag's spelling where it is not ``--field-name``, and how a string is parsed (by
default the field's type: int, float or str; a bool is a ``--flag/--no-flag`` pair).
``add_flag``/``cli_fields`` build the argparse actions (dest = the field's name) and
``from_namespace`` maps a parsed namespace back; ``check_choices`` validates against the same
choices. Used by ``EngineArgs`` (pagellm/engine_args.py); plain stdlib, cheap to import.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Opt:
    help: str | None = None
    choices: tuple[Any, ...] | None = None  # the flag's choices and check_choices' allowed values
    flag: str | None = None  # the spelling where it is not --field-name
    aliases: tuple[str, ...] = ()  # more spellings (-tp)
    parse: Callable[[str], Any] | None = None  # str -> value; default: from the field's type
    nargs: str | None = None
    from_cli: Callable[[Any], Any] | None = None  # parsed value -> field value
    server: bool = False  # a serving flag: `pagellm serve` places it among its own (add_flag)


def option(default: Any, help: str | None = None, **kwargs: Any) -> Any:
    """A dataclass field with a default and its flag's description (``Opt``'s fields)."""
    return dataclasses.field(default=default, metadata={"cli": Opt(help, **kwargs)})


def opt_of(f: dataclasses.Field) -> Opt | None:
    return f.metadata.get("cli")


def field_help(cls: type, name: str) -> str | None:
    opt = next(opt_of(f) for f in dataclasses.fields(cls) if f.name == name)
    return opt.help if opt is not None else None


def flag_name(f: dataclasses.Field) -> str:
    opt = opt_of(f)
    return (opt.flag if opt is not None and opt.flag else "--" + f.name.replace("_", "-"))


def cli_fields(cls: type, exclude: Iterable[str] = (), server: bool = False
               ) -> list[dataclasses.Field]:
    """The fields with a flag, in declaration order (server ones only when ``server``)."""
    skip = set(exclude)
    return [f for f in dataclasses.fields(cls)
            if (opt := opt_of(f)) is not None and f.name not in skip and opt.server == server]


def _parser_for(hint: Any, name: str) -> Callable[[str], Any]:
    """int, float or str from the annotation (``int | None`` -> int)."""
    if hint in (int, float, str):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1 and args[0] in (int, float, str):
        return args[0]
    raise TypeError(f"{name}: a field of type {hint} needs Opt(parse=...) to be a flag")


def add_flag(parser: Any, cls: type, name: str, help: str | None = None) -> None:
    """Add field ``name`` of ``cls`` to ``parser`` (a parser or an argument group); ``help``
    replaces the field's help text."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    opt = opt_of(f)
    assert opt is not None, f"{cls.__name__}.{name} has no flag"
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help or opt.help}
    hint = typing.get_type_hints(cls)[f.name]
    if hint is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = opt.parse or _parser_for(hint, f.name)
        if opt.choices is not None:
            kwargs["choices"] = opt.choices
        if opt.nargs is not None:
            kwargs["nargs"] = opt.nargs
    parser.add_argument(flag_name(f), *opt.aliases, **kwargs)


def from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    """``cls`` from the flags ``ns`` holds; fields without one keep their defaults."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        opt = opt_of(f)
        if opt is None or not hasattr(ns, f.name):
            continue
        value = getattr(ns, f.name)
        values[f.name] = opt.from_cli(value) if opt.from_cli is not None else value
    return cls(**values)


def check_choices(obj: Any) -> None:
    """ValueError naming the flag for a field whose value is not one of its choices."""
    for f in dataclasses.fields(obj):
        opt = opt_of(f)
        if opt is None or opt.choices is None:
            continue
        value = getattr(obj, f.name)
        if value not in opt.choices:
            raise ValueError(f"{flag_name(f)} must be one of "
                             f"{', '.join(map(str, opt.choices))}, got {value!r}.")


def json_object_flag(value: str | dict, flag: str, keys: Iterable[str], example: str
                     ) -> dict[str, Any] | None:
    """A JSON-object flag's value (a JSON string or a dict) as a dict whose keys are all among
    ``keys``; None for an empty string. ValueError naming ``flag`` (``example`` shows a valid
    value) on bad JSON, a non-object, or unknown keys."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: not valid JSON ({e}); e.g. '{example}'.") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(value).__name__}.")
    allowed = tuple(keys)
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ValueError(f"{flag}: unknown key(s) {', '.join(map(repr, unknown))}; the keys "
                         f"are {', '.join(allowed)}.")
    return value
