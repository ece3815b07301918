"""Settings of kvctl's LMCache plugin: per-rank URL from a {rank} template or a list, ACL user + password file, one error per bad key.

Pure (no LMCache import): runs in every environment.
"""

from __future__ import annotations

import pytest

from kvctl.connector.lmcache_settings import PluginConfigError, plugin_settings

URL = "remote_storage_plugin.kvctl.url"


def test_template_expands_to_this_rank():
    s = plugin_settings({URL: "resp://valkey-{rank}:6379"}, "kvctl", 3)
    assert s.url == "resp://valkey-3:6379"
    assert s.rank == 3 and s.timeout_s == 2.0 and s.pool_size == 4


def test_list_indexed_by_rank_and_plugin_instance_name():
    extra = {"kvctl_remote_urls": ["resp://127.0.0.1:7000", "resp://127.0.0.1:7001"],
             "remote_storage_plugin.kvctl.a.timeout_s": "0.25", "remote_storage_plugin.kvctl.a.pool_size": 2}
    s = plugin_settings(extra, "kvctl.a", 1)
    assert s.url == "resp://127.0.0.1:7001"
    assert s.timeout_s == 0.25 and s.pool_size == 2


def test_acl_user_and_password_file(tmp_path):
    pw = tmp_path / "engine.pw"
    pw.write_text("p@ss/word\n")
    pw.chmod(0o600)
    s = plugin_settings({URL: "resp://10.0.0.{rank}:6379", "kvctl_username": "kvctl-engine",
                         "kvctl_password_file": str(pw)}, "kvctl", 2)
    # '@' -> %40 and '/' -> %2F in the userinfo; the trailing newline of the file is not part of the password
    assert s.url == "resp://kvctl-engine:p%40ss%2Fword@10.0.0.2:6379"
    assert "p@ss" not in repr(s) and s.redacted_url == "resp://kvctl-engine:***@10.0.0.2:6379/0"


@pytest.mark.parametrize("extra,kw,needle", [
    ({}, {}, "exactly one of"),
    ({URL: "resp://a:1", "kvctl_remote_urls": ["resp://a:1"]}, {}, "exactly one of"),
    ({"kvctl_remote_urls": ["resp://a:1"]}, {}, "no URL for rank 1"),
    ({"kvctl_remote_urls": "resp://a:1"}, {}, "expected a list"),
    ({URL: "http://a:1"}, {}, "unsupported scheme"),
    ({URL: ""}, {}, "expected a URL string"),
    ({URL: "resp://a:1", "kvctl_username": "u"}, {}, "needs extra_config.kvctl_password_file"),
    ({URL: "resp://a:1", "kvctl_password_file": "/nonexistent/pw"}, {}, "cannot read password file /nonexistent/pw"),
    ({URL: "resp://a:1", "remote_storage_plugin.kvctl.timeout_s": 0}, {}, r"must be in \[0.01, 3600\], got 0"),
    ({URL: "resp://a:1", "remote_storage_plugin.kvctl.timeout_s": "soon"}, {}, "expected a number"),
    ({URL: "resp://a:1", "remote_storage_plugin.kvctl.pool_size": 1.5}, {}, "expected an integer"),
    ({URL: "resp://a:1"}, {"remote_url": "resp://a:1"}, "write every chunk twice"),
    ({URL: "resp://a:1"}, {"save_unfull_chunk": True}, "save_unfull_chunk"),
])
def test_bad_settings_name_the_key(extra, kw, needle):
    with pytest.raises(PluginConfigError, match=needle):
        plugin_settings(extra, "kvctl", 1, **kw)


def test_empty_password_file_refused(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("\n")
    pw.chmod(0o600)
    with pytest.raises(PluginConfigError, match="is empty"):
        plugin_settings({URL: "resp://a:1", "kvctl_password_file": str(pw)}, "kvctl", 0)


def test_password_file_open_to_every_user_refused_like_everywhere_else(tmp_path):
    """Issue 22: one reader for every password file; the plugin used to read a 0644 file that the CLI refuses."""
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    pw.chmod(0o644)
    with pytest.raises(PluginConfigError, match=r"kvctl_password_file: .*open to every user") as e:
        plugin_settings({URL: "resp://a:1", "kvctl_password_file": str(pw)}, "kvctl", 0)
    assert "s3cret" not in str(e.value)


@pytest.mark.parametrize("key,value,needle", [
    # issue 30 item 8: an integer beyond float range raised OverflowError; no upper bound let 1e20 through
    ("remote_storage_plugin.kvctl.timeout_s", 10**400, "an integer of 401 digits"),
    ("remote_storage_plugin.kvctl.timeout_s", 1e18, r"\[0.01, 3600\]"),
    ("remote_storage_plugin.kvctl.timeout_s", 1e-300, r"\[0.01, 3600\]"),
    ("remote_storage_plugin.kvctl.timeout_s", float("nan"), "finite"),
    ("remote_storage_plugin.kvctl.pool_size", 10**20, r"\[1, 1024\]"),
    ("remote_storage_plugin.kvctl.instances_per_rank", 65, r"\[1, 64\]"),
])
def test_every_number_has_a_range_and_a_clear_error(key, value, needle):
    with pytest.raises(PluginConfigError, match=needle) as e:
        plugin_settings({URL: "resp://a-{rank}-{instance}:1" if "instances" in key else "resp://a-{rank}:1", key: value},
                        "kvctl", 0)
    assert str(e.value).startswith(f"extra_config.{key}: ")


def test_several_instances_per_rank_by_template_and_by_list():
    s = plugin_settings({URL: "resp://v-{rank}-{instance}:6379", "remote_storage_plugin.kvctl.instances_per_rank": 3},
                        "kvctl", 1)
    assert s.urls == ("resp://v-1-0:6379", "resp://v-1-1:6379", "resp://v-1-2:6379")
    assert "+2 more instances" in s.redacted_url
    s = plugin_settings({"kvctl_remote_urls": [["resp://a:1", "resp://a:2"], ["resp://b:1", "resp://b:2"]]}, "kvctl", 1)
    assert s.urls == ("resp://b:1", "resp://b:2")
    with pytest.raises(PluginConfigError, match="instances_per_rank: 3, but every entry"):
        plugin_settings({"kvctl_remote_urls": [["resp://a:1", "resp://a:2"]],
                         "remote_storage_plugin.kvctl.instances_per_rank": 3}, "kvctl", 0)
    with pytest.raises(PluginConfigError, match=r"instances_per_rank: missing"):  # {instance} but no K: not instance 0
        plugin_settings({URL: "resp://v-{rank}-{instance}:1"}, "kvctl", 0)
    with pytest.raises(PluginConfigError, match=r"need \{instance\}"):
        plugin_settings({URL: "resp://v-{rank}:1", "remote_storage_plugin.kvctl.instances_per_rank": 2}, "kvctl", 0)
