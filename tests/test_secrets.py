"""Credentials never show themselves."""

from __future__ import annotations

import pickle

import pytest

from kvtier._secrets import Secret, redact


def test_a_secret_hides_its_value_in_every_text_form():
    secret = Secret("hunter2-hunter2")
    assert secret.value == "hunter2-hunter2"
    for text in (repr(secret), str(secret), f"{secret}", f"{secret!r}", repr([secret])):
        assert "hunter2" not in text


def test_a_secret_refuses_to_be_pickled():
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(Secret(b"k" * 32))


def test_redact_hides_credentials_at_any_depth():
    config = {
        "cpu_bytes_to_use": 1,
        "secondary_tiers": [
            {"type": "s3", "secret_access_key": "abc", "access_key_id": "id"},
            {"type": "p2p", "secret": "xyz", "tls": {"password": "pw"}},
            {"type": "custom", "token": Secret("t")},
        ],
        "other": Secret("s"),
    }
    shown = repr(redact(config))
    for hidden in ("abc", "'id'", "xyz", "'pw'", "'t'", "'s'"):
        assert hidden not in shown
    assert "cpu_bytes_to_use" in shown and "custom" in shown


def test_redact_leaves_a_credential_that_is_not_set_as_none():
    shown = redact({"session_token": None, "secret": "xyz", "tls": {"password": None}})
    assert shown == {"session_token": None, "secret": "<hidden>", "tls": {"password": None}}
