"""The p2p tier's parameters: parsed once, every bad one named, the secret never shown."""

from __future__ import annotations

import pytest

from kvtier import ConfigError
from kvtier.tiers.p2p.settings import (
    FRAME_SLACK,
    PeerSettings,
    TlsSettings,
    read_secret_file,
)
from kvtier.tiers.p2p.wire import chunk_body_bytes

PATH = "secondary_tiers[0]"
SECRET_VALUE = "Sup3r-Secret-Value-Never-To-Be-Shown"


def parse(**params) -> PeerSettings:
    return PeerSettings.from_params({"secret": SECRET_VALUE, **params}, PATH)


def test_defaults_listen_on_loopback_read_from_nobody_and_time_out_in_seconds():
    settings = parse()
    assert settings.listen == ("127.0.0.1", 0)
    assert settings.peers == ()
    assert settings.secret is not None and settings.secret.value == SECRET_VALUE.encode()
    assert (settings.connect_timeout_s, settings.io_timeout_s) == (5.0, 10.0)
    assert (settings.reconnect_initial_s, settings.reconnect_max_s) == (0.1, 5.0)
    assert settings.max_inbound_connections == 64 and settings.tls is None
    assert (settings.retry_corrupt_after_s, settings.retry_corrupt_max_s) == (1.0, 60.0)


def test_addresses_are_parsed_and_ipv6_is_written_in_brackets():
    settings = parse(listen="[::]:7070", peers=["10.0.0.6:7070", "[fe80::1]:7071"])
    assert settings.listen == ("::", 7070)
    assert settings.peers == (("10.0.0.6", 7070), ("fe80::1", 7071))


def test_a_first_reconnect_wait_above_the_default_cap_raises_the_cap():
    assert parse(reconnect_initial_s=8).reconnect_max_s == 8.0


def test_a_first_wait_after_a_corrupt_chunk_above_the_default_cap_raises_the_cap():
    settings = parse(retry_corrupt_after_s=90)
    assert (settings.retry_corrupt_after_s, settings.retry_corrupt_max_s) == (90.0, 90.0)


def test_parsing_opens_nothing_a_secret_file_is_read_when_the_tier_starts():
    settings = PeerSettings.from_params({"secret_file": "/nonexistent/secret"}, PATH)
    assert settings.secret is None and settings.secret_file == "/nonexistent/secret"


def test_tls_settings_are_parsed_with_hostname_checks_on_by_default():
    settings = parse(tls={"cert": "c.pem", "key": "k.pem", "ca": "ca.pem"})
    assert settings.tls == TlsSettings("c.pem", "k.pem", "ca.pem", check_hostname=True)


def test_the_settings_repr_hides_the_secret():
    assert SECRET_VALUE not in repr(parse())


@pytest.mark.parametrize(
    ("params", "path"),
    [
        ({"secret": None}, "secret"),
        ({"secret_file": "/nonexistent"}, "secret"),
        ({"secret": "too-short"}, "secret"),
        ({"secret": 1234567890123456789012}, "secret"),
        ({"listen": "nowhere"}, "listen"),
        ({"listen": "127.0.0.1:70000"}, "listen"),
        ({"listen": "::1:80"}, "listen"),
        ({"peers": "127.0.0.1:1"}, "peers"),
        ({"peers": ["127.0.0.1"]}, "peers[0]"),
        ({"peers": ["127.0.0.1:0"]}, "peers[0]"),
        ({"peers": ["h:1", "h:1"]}, "peers[1]"),
        ({"io_timeout_s": 0}, "io_timeout_s"),
        ({"connect_timeout_s": "fast"}, "connect_timeout_s"),
        ({"max_frame_bytes": 1024}, "max_frame_bytes"),
        ({"reconnect_initial_s": 1, "reconnect_max_s": 0.5}, "reconnect_max_s"),
        ({"max_inbound_connections": 0}, "max_inbound_connections"),
        ({"retry_corrupt_after_s": 0}, "retry_corrupt_after_s"),
        ({"retry_corrupt_after_s": 2, "retry_corrupt_max_s": 1}, "retry_corrupt_max_s"),
        ({"tls": "on"}, "tls"),
        ({"tls": {"cert": "c.pem"}}, "tls.key"),
        ({"tls": {"cert": "c", "key": "k", "ca": "a", "verify": False}}, "tls.verify"),
        ({"secrte": "typo"}, "secrte"),
    ],
)
def test_bad_settings_name_their_key_and_never_show_the_secret(params, path):
    tier = {"secret": SECRET_VALUE, **params}
    if tier["secret"] is None:
        del tier["secret"]
    with pytest.raises(ConfigError) as caught:
        PeerSettings.from_params(tier, PATH)
    assert caught.value.path == f"{PATH}.{path}"
    assert str(caught.value).startswith(f"{PATH}.{path}: ")
    message = str(caught.value)
    assert SECRET_VALUE not in message and "1234567890123456789012" not in message


# --------------------------------------------------------------- frame limit


def test_the_default_frame_limit_is_one_chunk_frame_and_room_for_control_frames():
    assert parse().frame_limit(1 << 20, PATH) == chunk_body_bytes(1 << 20) + FRAME_SLACK


def test_a_frame_limit_that_cannot_hold_one_chunk_is_refused_for_that_chunk_size():
    settings = parse(max_frame_bytes=1 << 20)
    assert settings.frame_limit(64 * 1024, PATH) == 1 << 20
    with pytest.raises(ConfigError) as caught:
        settings.frame_limit(1 << 20, PATH)
    assert caught.value.path == f"{PATH}.max_frame_bytes"
    assert f">= {chunk_body_bytes(1 << 20)}" in caught.value.problem


# --------------------------------------------------------- files at start time


def test_a_secret_file_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET_VALUE + "\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError) as caught:
        read_secret_file(str(path), f"{PATH}.secret_file")
    message = str(caught.value)
    assert message.startswith(f"{PATH}.secret_file: ")
    assert "group" in message and "world" in message and "chmod 600" in message
    assert SECRET_VALUE not in message


def test_a_private_secret_file_gives_its_secret_without_the_trailing_newline(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET_VALUE + "\n")
    path.chmod(0o600)
    assert read_secret_file(str(path), PATH).value == SECRET_VALUE.encode()


@pytest.mark.parametrize(
    ("content", "problem"), [(None, "not a regular file"), ("short\n", "fewer than 16 bytes")]
)
def test_a_secret_file_that_is_a_directory_or_too_short_is_refused(tmp_path, content, problem):
    path = tmp_path / "secret"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    path.chmod(0o700 if content is None else 0o600)
    with pytest.raises(ConfigError, match=problem):
        read_secret_file(str(path), PATH)


def test_tls_files_that_cannot_be_loaded_are_named_by_their_key(tmp_path):
    tls = TlsSettings(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"), str(tmp_path / "ca.pem"))
    with pytest.raises(ConfigError) as caught:
        tls.contexts(f"{PATH}.tls")
    assert caught.value.path == f"{PATH}.tls.cert"
