"""Credentials that never show themselves: a wrapper for one, and redaction of many."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, NoReturn, TypeVar

__all__ = ["SECRET_KEYS", "Secret", "redact"]

_V = TypeVar("_V", str, bytes)

#: Setting names whose values are credentials: logs, reprs and errors never show them.
#: ``access_key`` and ``secret_key`` are vLLM's names in an object store's ``store_config``.
SECRET_KEYS = frozenset(
    {
        "secret",
        "secret_access_key",
        "session_token",
        "access_key_id",
        "access_key",
        "secret_key",
        "password",
        "token",
    }
)


class Secret(Generic[_V]):
    """A credential (an S3 key, the p2p secret) that hides its value.

    ``repr``, ``str`` and formatting show ``<hidden>``; pickling refuses, so a secret
    never travels to another process by accident. :attr:`value` is the only way in.
    """

    __slots__ = ("_value",)
    _value: _V

    def __init__(self, value: _V) -> None:
        self._value = value

    @property
    def value(self) -> _V:
        return self._value

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError("a secret cannot be pickled")


def redact(value: object) -> object:
    """``value`` with every credential inside it replaced by ``'<hidden>'``.

    A credential that is not set (None) stays None: "not set" gives nothing away, and
    ``<hidden>`` would claim a value that is not there.
    """
    if isinstance(value, Secret):
        return "<hidden>"
    if isinstance(value, Mapping):
        return {
            k: "<hidden>" if k in SECRET_KEYS and v is not None else redact(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact(item) for item in value]
    return value
