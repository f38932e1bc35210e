"""Who a request is: API keys belong to tenants, and a tenant sees only what it made.

``harts serve`` serves one tenant per key. ``--api-key`` alone is one tenant, ``default``; a
keys file (``--keys-file``) names several, in TOML::

    [tenants.alice]
    key = "tml-3f9c0b6e1d2a4c58b7e6"

    [tenants.bob]
    key = "tml-0a1b2c3d4e5f60718293"

A key is ``tml-`` (the tinker SDK refuses keys without it) followed by at least
``MIN_SECRET_CHARS`` printable ASCII characters and no spaces, so that a key is a secret and not
a label; no two tenants share a key. A tenant name is 1-64 letters, digits, ``_``, ``-`` or ``.``
(it is written into ``run.json``). Every check fails with one ``UserError`` line naming the
option or the tenant, before the server loads anything.

``Keys.tenant`` finds the tenant of a presented key by comparing it with every key in constant
time (``hmac.compare_digest``, all keys each time), so neither the timing nor the order of the
keys tells how much of a guess was right.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harts.errors import UserError

__all__ = ["DEFAULT_TENANT", "KEY_PREFIX", "MIN_SECRET_CHARS", "Keys", "check_keys", "load_keys_file"]

#: the tenant of ``--api-key`` (and of runs written before runs recorded their tenant)
DEFAULT_TENANT = "default"
#: what every key starts with (the tinker SDK refuses other keys)
KEY_PREFIX = "tml-"
#: the fewest characters a key has after ``tml-``
MIN_SECRET_CHARS = 16

_TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_KEYS_FILE_SHAPE = '[tenants.NAME] tables, each with key = "tml-..."'


def _key_problem(key: str) -> str | None:
    """Why ``key`` is not a usable key, or None."""
    if not key.startswith(KEY_PREFIX):
        return f"must start with {KEY_PREFIX!r} (the tinker SDK refuses any other key)"
    secret = key[len(KEY_PREFIX) :]
    if not secret.isascii() or not secret.isprintable() or any(c.isspace() for c in secret):
        return "may hold only printable ASCII characters without spaces (it travels in an HTTP header)"
    if len(secret) < MIN_SECRET_CHARS:
        return (
            f"has {len(secret)} characters after {KEY_PREFIX!r}, at least {MIN_SECRET_CHARS} are needed so that "
            f"it is a secret (e.g. tml-$(python -c 'import secrets; print(secrets.token_hex(16))'))"
        )
    return None


def check_keys(tenants: Mapping[str, str], *, source: str) -> None:
    """``UserError`` (one line) for a tenant with a bad name or key, or a key two tenants share.
    ``source``: the option the keys came from (``--keys-file PATH``), named in the message;
    ``--api-key`` names no tenant (it has one)."""
    if not tenants:
        raise UserError(f"{source}: no tenants; give {_KEYS_FILE_SHAPE}")
    owner: dict[str, str] = {}
    for name, key in tenants.items():
        where = source if source == "--api-key" else f"{source}: tenant {name!r}"
        if not _TENANT_NAME.fullmatch(name):
            raise UserError(f"{where}: a tenant name is 1-64 letters, digits, '_', '-' or '.'")
        problem = _key_problem(key)
        if problem is not None:
            raise UserError(f"{where}: the key {problem}")
        if key in owner:
            raise UserError(f"{where}: has the same key as tenant {owner[key]!r}; each tenant needs its own key")
        owner[key] = name


def load_keys_file(path: str | Path) -> dict[str, str]:
    """Tenant name -> key from a keys file (module docstring), checked (``check_keys``)."""
    from harts.trainer.options import read_toml

    source = f"--keys-file {path}"
    data = read_toml(str(path), source)
    extra = sorted(set(data) - {"tenants"})
    if extra:
        raise UserError(f"{source}: unknown top-level entry {extra[0]!r}; the file holds only {_KEYS_FILE_SHAPE}")
    tables = data.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise UserError(f"{source}: no tenants; give {_KEYS_FILE_SHAPE}")
    tenants = {name: _tenant_key(source, name, table) for name, table in tables.items()}
    check_keys(tenants, source=source)
    return tenants


def _tenant_key(source: str, name: str, table: Any) -> str:
    """The key of tenant ``name``'s table in a keys file."""
    if not isinstance(table, dict):
        raise UserError(f'{source}: tenants.{name} must be a table ([tenants.{name}] with key = "tml-...")')
    extra = sorted(set(table) - {"key"})
    if extra:
        raise UserError(f"{source}: tenant {name!r}: unknown field {extra[0]!r}; a tenant has only key")
    key = table.get("key")
    if not isinstance(key, str):
        got = "nothing" if key is None else type(key).__name__
        raise UserError(f'{source}: tenant {name!r}: key must be a string "tml-...", got {got}')
    return key


class Keys:
    """The server's keys and their tenants (module docstring)."""

    def __init__(self, tenants: Mapping[str, str]) -> None:
        self._keys = [(key.encode(), name) for name, key in tenants.items()]

    def tenant(self, presented: bytes) -> str | None:
        """The tenant whose key is ``presented``, or None; every key is compared each time."""
        found = None
        for key, name in self._keys:
            if hmac.compare_digest(presented, key) and found is None:
                found = name
        return found
