"""No object that holds a password shows it: repr, str, format and logging mask it (issue 44, defect 11).

``repr(ConnectorSettings)`` showed the password through ``rank_urls`` (``resp://:PASSWORD@…``) although
``password_file`` was ``repr=False``. Every settings object, dataclass and error message of the engine side
(connector/, plugins/) and kvctl's objects that hold a tier or engine URL, a password or an API key, show
URLs with their passwords masked (``***``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvctl.connector.lmcache_settings import PluginConfigError, plugin_settings
from kvctl.connector.settings import ConnectorConfigError, parse_settings
from kvctl.connector.urls import parse_resp_url, redact_url_text

SECRET = "Pa55-SECRET-word"


def pw_file(tmp_path: Path) -> str:
    p = tmp_path / "pw"
    p.write_text(SECRET + "\n")
    p.chmod(0o600)
    return str(p)


def shown(obj) -> list[str]:
    """Every way the object reaches a log or a message: repr, str, format, %s and %r through logging."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    log = logging.getLogger("kvctl.test.secrets")
    handler = Keep()
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("settings %s", obj)
        log.warning("settings %r", obj)
        log.warning("settings: %s", [obj])  # inside a container: its repr
    finally:
        log.removeHandler(handler)
    return [repr(obj), str(obj), f"{obj}", f"{obj!r}", *records]


def assert_hidden(obj, secret: str = SECRET) -> None:
    for text in shown(obj):
        assert secret not in text, text


def test_connector_settings_never_show_the_password(tmp_path):
    s = parse_settings({"urls": [["resp://127.0.0.1:7000", "resp://127.0.0.1:7001"]], "chunk_tokens": 64,
                        "password_file": pw_file(tmp_path)}, 1)
    assert SECRET in s.rank_urls[0][0]  # the store connects with it
    assert_hidden(s)
    assert "resp://:***@127.0.0.1:7000" in repr(s) and "chunk_tokens=64" in repr(s)
    inline = parse_settings({"urls": [f"resp://alice:{SECRET}@h:1"], "chunk_tokens": 64}, 1)
    assert_hidden(inline)
    assert "resp://alice:***@h:1" in repr(inline)


def test_plugin_settings_and_parsed_urls_never_show_the_password(tmp_path):
    s = plugin_settings({"kvctl_remote_urls": [["resp://h:1", "resp://h:2"]], "kvctl_username": "eng",
                         "kvctl_password_file": pw_file(tmp_path)}, "kvctl", 0)
    assert_hidden(s)
    assert_hidden(parse_resp_url(f"rediss://u:{SECRET}@h:1/2"))


@pytest.mark.parametrize("cfg", [
    {"url": "http://valkey-{rank}:6379"},  # a scheme the client does not speak
    {"url": "resp://valkey-{rank}:6379/db"},
    {"url": "resp://valkey-{rank}:6379?verify=no"},
    {"urls": [["resp://h:1", "resp://h:1"]]},  # one server twice
])
def test_errors_about_a_url_never_show_the_password(tmp_path, cfg):
    with pytest.raises(ConnectorConfigError) as e:
        parse_settings(dict(cfg, chunk_tokens=64, password_file=pw_file(tmp_path)), 1)
    assert SECRET not in str(e.value) and "\n" not in str(e.value)
    inline = {k: ([[u.replace("://", f"://:{SECRET}@") for u in r] for r in v] if k == "urls" else
                  v.replace("://", f"://:{SECRET}@")) for k, v in cfg.items()}
    with pytest.raises(ConnectorConfigError) as e:
        parse_settings(dict(inline, chunk_tokens=64), 1)
    assert SECRET not in str(e.value), str(e.value)
    lm = {"kvctl_remote_urls": cfg["urls"]} if "urls" in cfg else {"remote_storage_plugin.kvctl.url": cfg["url"]}
    with pytest.raises(PluginConfigError) as e:
        plugin_settings(dict(lm, kvctl_username="u", kvctl_password_file=pw_file(tmp_path)), "kvctl", 0)
    assert SECRET not in str(e.value), str(e.value)


@pytest.mark.parametrize("url,masked", [
    (f"resp://:{SECRET}@h:1", "resp://:***@h:1"),
    (f"redis://alice:{SECRET}@h:1/2?ssl_cert_reqs=none", "redis://alice:***@h:1/2?ssl_cert_reqs=none"),
    (f"resp://:pa/{SECRET}@h:1", "resp://:***@h:1"),  # an unquoted '/' in the password
    (f"resp://:pa@{SECRET}@h:1", "resp://:***@h:1"),  # an unquoted '@' in the password
    (f"http://h:1/metrics?api_key={SECRET}", "http://h:1/metrics?api_key=***"),
    ("resp://valkey-{rank}:6379", "resp://valkey-{rank}:6379"),
    ("resp://engine@h:1", "resp://engine@h:1"),
])
def test_a_url_as_text_masks_its_password(url, masked):
    assert redact_url_text(url) == masked


def test_kvctl_objects_holding_a_url_or_a_secret_never_show_it():
    from kvctl.bench.worker import WorkerConfig
    from kvctl.core.engine_http import EngineHttp
    from kvctl.drill.config import EngineSettings
    from kvctl.ops.doctor import DoctorInput
    from kvctl.ops.exporter import ExporterConfig
    from kvctl.replay.sender import ReplayOptions
    from kvctl.tier.render_targets import FleetSpec
    from kvctl.tier.server import ValkeyProcess
    from kvctl.tier.spec import Auth
    from kvctl.tier.status import InstanceStatus
    from kvctl.tier.targets import Target

    resp, http = f"resp://:{SECRET}@h:1", f"http://user:{SECRET}@engine:8000"
    target = Target(0, "h", 1, resp, SECRET)
    objects = [
        target,
        Auth(password=SECRET),
        FleetSpec("systemd", 1, 1 << 20, 1, 7000, "h", 6379, Auth(password=SECRET), SECRET, "kv", "kv", None, "img"),
        ValkeyProcess("h", 1, 2, Path("c"), Path("l"), SECRET),
        EngineHttp(api_key=SECRET),
        ExporterConfig(engine_urls=(http,), targets=(target,), http=EngineHttp(api_key=SECRET)),
        DoctorInput(engine_urls=(http,), targets=(target,)),
        ReplayOptions(url=http),
        EngineSettings(remote_urls=[resp], chunk_bytes=1, prefill_tokens_per_s=1.0, t0_s=0.0, stream_bytes_per_s=1.0),
        WorkerConfig(0, 0, resp, "get", "k", 1, 1, 1, 1.0, 1.0, 0, 1.0),
        InstanceStatus(rank=0, host="h", port=1, pid=1, url=resp, up=True),
    ]
    for obj in objects:
        assert_hidden(obj)
    assert "url='resp://:***@h:1'" in repr(target)


def test_the_exporters_window_shows_instance_urls_masked():
    """What the exporter analyses (and a finding may quote) holds the instance URLs masked, as `diagnose` does."""
    from kvctl.diagnose.capture import Sample
    from kvctl.ops.exporter import Exporter, ExporterConfig
    from kvctl.tier.targets import Target

    cfg = ExporterConfig(engine_urls=(f"http://u:{SECRET}@127.0.0.1:9/metrics",),
                         targets=(Target(0, "127.0.0.1", 9, f"resp://:{SECRET}@127.0.0.1:9", SECRET),))
    ticks = iter(range(100))
    exp = Exporter(cfg, take_sample=lambda urls, targets, t: Sample(float(next(ticks)), [None], [None]))
    try:
        exp.step()
        exp.step()
        capture = exp.window_capture()
    finally:
        exp.close()
    assert capture.valkey_urls == ["resp://:***@127.0.0.1:9/0"]
    assert SECRET not in repr(capture) and SECRET not in str(capture.engine_urls)


def test_the_engine_sides_clients_never_show_the_password():
    """The objects that connect with the password (client, rank tier, lookup, store) show none of it."""
    import torch

    from kvctl.connector.lookup import TierLookup
    from kvctl.connector.resp import RespClient
    from kvctl.connector.store import ShardedStore
    from kvctl.connector.striped import RankTier

    urls = [f"resp://:{SECRET}@127.0.0.1:9", f"resp://eng:{SECRET}@127.0.0.1:10"]  # nothing listens: never used
    client, tier = RespClient(urls[0], timeout_s=0.5), RankTier(urls, 1, timeout_s=0.5)
    lookup = TierLookup([urls], 4, "m", "f", 0.5)
    store = ShardedStore(0, 1, [urls], 0, (4, 2), torch.float32, chunk_tokens=4, timeout_s=0.5, instances_per_rank=2)
    try:
        for obj in (client, client.url, tier, lookup, store):
            assert_hidden(obj)
        assert SECRET not in tier.url and SECRET not in str(store.url)
    finally:
        client.close()
        tier.close()
        lookup.close()
        store.close()
