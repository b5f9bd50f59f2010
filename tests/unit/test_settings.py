"""One settings object, validated at start-up, errors naming the variable."""

from __future__ import annotations

import pytest

from renderfleet.errors import ConfigError
from renderfleet.settings import load_settings


def test_environment_is_read_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RENDERFLEET_POOL", "spot")
    monkeypatch.setenv("RENDERFLEET_REDIS_URL", "redis://:secret@10.0.0.5:6380/2")
    s = load_settings()
    assert s.pool == "spot" and s.redis_url == "redis://:secret@10.0.0.5:6380/2" and s.watch_reclaim
    assert load_settings(pool="baseline").pool == "baseline"
    assert not load_settings(pool="baseline").watch_reclaim


def test_a_worker_renders_auto_batches_by_default_or_a_fixed_number(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().render_batch == "auto" and load_settings().fixed_render_batch is None
    assert load_settings(render_batch=" AUTO ").fixed_render_batch is None
    assert load_settings(render_batch="16").fixed_render_batch == 16
    monkeypatch.setenv("RENDERFLEET_RENDER_BATCH", "8")  # the variable the README documents; a flag wins
    assert load_settings().fixed_render_batch == 8 and load_settings(render_batch="auto").fixed_render_batch is None


def test_compile_is_off_unless_the_flag_or_its_variable_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not load_settings().compile
    for value, on in (("1", True), ("true", True), ("0", False), ("false", False)):
        monkeypatch.setenv("RENDERFLEET_COMPILE", value)
        assert load_settings().compile is on, value
    with pytest.raises(ConfigError, match="RENDERFLEET_COMPILE"):
        monkeypatch.setenv("RENDERFLEET_COMPILE", "sometimes")
        load_settings()


def test_tls_url_verifies_the_server_by_default() -> None:
    assert load_settings(redis_url="rediss://:pw@host:6380/0").redis_url == "rediss://:pw@host:6380/0?ssl_cert_reqs=required"
    assert load_settings(redis_url="rediss://h/0?ssl_cert_reqs=none").redis_url == "rediss://h/0?ssl_cert_reqs=none"


@pytest.mark.parametrize(
    ("env", "value", "needle"),
    [
        ("RENDERFLEET_REDIS_URL", "http://localhost", "RENDERFLEET_REDIS_URL"),
        ("RENDERFLEET_STORE", "s3://", "RENDERFLEET_STORE"),
        ("RENDERFLEET_POOL", "Spot Pool", "RENDERFLEET_POOL"),
        ("RENDERFLEET_LEASE_SECONDS", "-1", "RENDERFLEET_LEASE_SECONDS"),
        ("RENDERFLEET_RECLAIM_WATCH", "maybe", "RENDERFLEET_RECLAIM_WATCH"),
        ("RENDERFLEET_HEARTBEAT_SECONDS", "5", "RENDERFLEET_HEARTBEAT_SECONDS"),
        ("RENDERFLEET_RENDER_BATCH", "0", "RENDERFLEET_RENDER_BATCH: must be auto or a whole number from 1 to 256"),
        ("RENDERFLEET_RENDER_BATCH", "many", "RENDERFLEET_RENDER_BATCH"),
    ],
)
def test_a_bad_value_is_reported_by_name(monkeypatch: pytest.MonkeyPatch, env: str, value: str, needle: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError, match=needle):
        load_settings()


def test_a_password_in_the_redis_url_never_appears_in_an_error() -> None:
    from renderfleet.settings import redact

    assert redact("rediss://:s3cret@redis.internal:6379/0") == "rediss://***@redis.internal:6379/0"
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    with pytest.raises(ConfigError) as err:
        load_settings(redis_url="http://:s3cret@redis.internal:6379/0")
    assert "s3cret" not in str(err.value) and "RENDERFLEET_REDIS_URL" in str(err.value)


def test_celery_task_events_are_off_unless_asked_for_flower(monkeypatch: pytest.MonkeyPatch) -> None:
    from renderfleet.celery_app import make_app

    assert not load_settings().task_events
    assert make_app("redis://127.0.0.1:1/0").conf.worker_send_task_events is False
    monkeypatch.setenv("RENDERFLEET_TASK_EVENTS", "1")
    assert load_settings().task_events
    app = make_app("redis://127.0.0.1:1/0", task_events=True)
    assert app.conf.worker_send_task_events is True and app.conf.task_send_sent_event is True
