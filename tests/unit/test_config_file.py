"""Settings from a TOML file, the environment and flags, and the messages a wrong value gets."""

import gc
import sys
from pathlib import Path

import pytest
import uvloop

from tether.cli import event_loop_factory
from tether.config import ConfigurationError, Settings
from tether.runtime import pause_gc_for_replay, tune_gc


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tether.toml"
    path.write_text(text)
    return path


def test_the_environment_overrides_the_file_and_flags_override_both(tmp_path):
    path = write(tmp_path, 'stream_replicas = 3\nlog_level = "debug"\nagents = ["m:A", "m:B"]\n'
                           'prefix = "fromfile"\n')
    settings = Settings.from_env({"TETHER_CONFIG_FILE": str(path), "TETHER_LOG_LEVEL": "error"},
                                 prefix="fromflag")
    assert settings.stream_replicas == 3 and settings.agents == ("m:A", "m:B")
    assert settings.log_level == "error" and settings.prefix == "fromflag"
    assert Settings.from_env({}, config_file=path).prefix == "fromfile"


def test_a_wrong_value_names_the_setting_its_source_and_what_it_accepts(tmp_path):
    path = write(tmp_path, 'log_format = "xml"\nstream_replicas = 9\n')
    with pytest.raises(ConfigurationError) as error:
        Settings.from_env({"TETHER_LOG_LEVEL": "loud"}, config_file=path)
    message = str(error.value)
    assert "TETHER_LOG_LEVEL='loud': expected one of 'debug', 'info', 'warning' or 'error'" in message
    assert f"log_format = 'xml' in {path}: expected one of 'auto', 'json' or 'console'" in message
    assert f"stream_replicas = 9 in {path}: Input should be less than or equal to 5" in message


def test_an_unknown_setting_or_a_broken_file_stops_with_the_list_of_settings(tmp_path):
    with pytest.raises(ConfigurationError, match=r"unknown setting\(s\) nats_urll; the settings"):
        Settings.from_env({}, config_file=write(tmp_path, 'nats_urll = "nats://x:4222"\n'))
    with pytest.raises(ConfigurationError, match="not valid TOML"):
        Settings.from_env({}, config_file=write(tmp_path, "stream_replicas = \n"))
    with pytest.raises(ConfigurationError, match="cannot read it"):
        Settings.from_env({"TETHER_CONFIG_FILE": str(tmp_path / "missing.toml")})


def test_nats_credentials_stay_out_of_the_url_and_out_of_messages():
    settings = Settings.from_env({"TETHER_NATS_URL": "nats://nats:4222",
                                  "TETHER_NATS_USER": "parent",
                                  "TETHER_NATS_PASSWORD": "s3cr/t"})
    assert settings.nats_url == "nats://nats:4222"
    assert settings.nats_connect_url == "nats://parent:s3cr%2Ft@nats:4222"
    assert "s3cr" not in repr(settings)
    with pytest.raises(ConfigurationError, match="already carries a user"):
        Settings.from_env({"TETHER_NATS_URL": "nats://a:b@nats:4222", "TETHER_NATS_USER": "c"})


def test_the_services_run_on_uvloop_unless_told_otherwise(monkeypatch) -> None:
    assert event_loop_factory("auto") is uvloop.new_event_loop
    assert event_loop_factory("uvloop") is uvloop.new_event_loop
    assert event_loop_factory("asyncio") is None
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed
    assert event_loop_factory("auto") is None
    with pytest.raises(ConfigurationError, match="TETHER_EVENT_LOOP=asyncio"):
        event_loop_factory("uvloop")


def test_an_unknown_event_loop_is_refused_with_the_accepted_values() -> None:
    with pytest.raises(ConfigurationError, match=r"auto.*uvloop.*asyncio"):
        Settings.from_env({"TETHER_EVENT_LOOP": "trio"})


@pytest.fixture
def restored_gc():
    threshold = gc.get_threshold()
    yield gc
    gc.unfreeze()
    gc.set_threshold(*threshold)
    gc.enable()


def test_the_services_collect_garbage_less_often_unless_told_otherwise(restored_gc) -> None:
    gc = restored_gc
    gc.set_threshold(700, 10, 10)
    tune_gc(Settings.from_env({}).gc_threshold)
    assert gc.get_threshold() == (10_000, 10, 10)
    assert gc.get_freeze_count() > 0  # what start-up created is out of the collector's sight

    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    tune_gc(Settings.from_env({"TETHER_GC_THRESHOLD": "0"}).gc_threshold)
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
    with pytest.raises(ConfigurationError, match="TETHER_GC_THRESHOLD"):
        Settings.from_env({"TETHER_GC_THRESHOLD": "-1"})


def test_a_replay_command_turns_the_collector_off_unless_told_otherwise(restored_gc) -> None:
    gc = restored_gc
    pause_gc_for_replay(Settings.from_env({}).gc_threshold)
    assert not gc.isenabled() and gc.get_freeze_count() > 0

    gc.enable()
    gc.unfreeze()
    pause_gc_for_replay(Settings.from_env({"TETHER_GC_THRESHOLD": "0"}).gc_threshold)
    assert gc.isenabled() and gc.get_freeze_count() == 0
