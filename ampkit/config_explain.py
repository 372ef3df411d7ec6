"""Plain words for OmegaConf's errors about a value: one of the wrong type (``Value '1000.0' of type 'float' could not
be converted to Integer``) or an interpolation that does not resolve (``KeyError raised while resolving
interpolation``). Each says the value as written, what it is, and what the key takes."""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from ampkit.wording import shown as shown_value

# OmegaConf's words for a value it cannot convert to the key's type, and what that type takes.
_CONVERTED = (
    (re.compile(r"Value '.*' of type '\w+' could not be converted to Integer", re.DOTALL), "an integer"),
    (re.compile(r"Value '.*' of type '\w+' could not be converted to Float", re.DOTALL), "a number"),
    (re.compile(r"Cannot convert '\w+' to string", re.DOTALL), "a string"),
    (re.compile(r"Value .* is not a valid input for <enum", re.DOTALL), "one of the key's values"),
)
_INCOMPATIBLE = re.compile(r"Value '.*' of type '\w+' is incompatible with type hint '(.+)'$", re.DOTALL)
# The resolvers OmegaConf registers itself; a name outside them (and the ones a program adds) is a typo.
OMEGACONF_RESOLVERS = ("oc.env", "oc.create", "oc.decode", "oc.deprecated", "oc.select", "oc.dict.keys",
                       "oc.dict.values")  # fmt: skip


def wrong_type(message: str, value: Any, valid: str | None) -> str | None:
    """``"1000.0 is a float, not an integer; expected an integer (write 1000)"`` for OmegaConf's could-not-convert
    ``message`` about ``value``; ``valid``: what the key takes, where a rule or an enum words it. None for any other
    message."""
    wanted = next((wanted for pattern, wanted in _CONVERTED if pattern.match(message)), None)
    hinted = _INCOMPATIBLE.match(message)
    if hinted:  # a Union key's (int | float | None): OmegaConf's words hold the whole value, however long
        wanted = f"of type {hinted.group(1)}"
    if wanted is None:
        return None
    if isinstance(value, bool):
        shown, what = str(value).lower(), "a boolean"
    elif isinstance(value, float):
        shown, what = repr(value), "a float, not an integer"
    elif isinstance(value, ListConfig | DictConfig):
        shown = shown_value(OmegaConf.to_container(value))
        what = "a list" if isinstance(value, ListConfig) else "a mapping"
    else:
        shown, what = shown_value(value), f"not {wanted}"
    integral = isinstance(value, float) and value.is_integer() and abs(value) < 2**63 and wanted == "an integer"
    hint = f" (write {int(value)})" if integral else ""
    return f"{shown} is {what}; expected {valid or wanted}{hint}"


def interpolation_problem(message: str) -> str | None:
    """What is wrong with an interpolation (``${...}``) OmegaConf could not resolve, and how to fix it; None where
    ``message`` is no such error."""
    unset = re.search(r"Environment variable '([^']+)' not found", message)
    if unset:
        name = unset.group(1)
        return (
            f"environment variable {name} is not set (${{oc.env:{name}}}); set it, or give a default: "
            f"${{oc.env:{name},<default>}}"
        )
    unknown = re.fullmatch(r"Unsupported interpolation type (\S+)", message)
    if unknown:
        return (
            f"${{{unknown.group(1)}:...}} names no resolver; OmegaConf's are {', '.join(OMEGACONF_RESOLVERS)}, and "
            "${key} names another config key"
        )
    if message.startswith("Recursive interpolation detected"):
        return "its ${...} leads back to itself (as a: ${b} with b: ${a}); give one of the keys in the cycle a value"
    unfound = re.fullmatch(r"Interpolation key '([\w.]+)' not found", message)
    if unfound:  # ${SCRATCH} in a YAML file: OmegaConf reads it as a config key before any path is expanded
        name = unfound.group(1)
        return f"{message}: ${{{name}}} names a config key; an environment variable is ${name} or ${{oc.env:{name}}}"
    return None


def malformed_interpolation(value: Any) -> str:
    """What a value OmegaConf's interpolation grammar cannot read (``${name``) is, and the forms it takes."""
    return (
        f"{shown_value(value)} is no valid interpolation (an unclosed or misspelt ${{...}}); write ${{key}} for "
        "another config key, ${oc.env:VAR} for an environment variable, or \\${ for a '${' meant as text"
    )
