"""One server spelled twice is one instance, refused in a rank's list of instances (issue 44, defect 19).

The vLLM connector took ``127.0.0.1:7000`` and ``localhost:7000`` (or ``resp://…:7000`` and ``redis://…:7000/0``) as
two instances of one rank, and the LMCache plugin took ``[[A, A]]`` unchecked: the rank striped its chunks over one
server twice, at half the bandwidth it was configured for. Each instance URL is compared as (address, port) --
every loopback spelling is one address, IP literals in their canonical form, other names as spelled (case and a
trailing dot aside), with no DNS lookup -- and a repeat is refused with one line naming both spellings, by the
connector's settings, the plugin's settings and ``kvctl deploy-valkey vllm-config`` / ``lmcache-config``.
"""

from __future__ import annotations

import socket

import pytest

from kvctl.connector.lmcache_settings import PluginConfigError, plugin_settings
from kvctl.connector.settings import ConnectorConfigError, parse_settings
from kvctl.connector.urls import server_address
from kvctl.core.errors import InvalidInput

SAME = [
    ("resp://127.0.0.1:7000", "resp://localhost:7000"),
    ("resp://h:7000", "redis://h:7000/0"),
    ("resp://h:7000", "resp://h:7000"),
    ("resp://h", "resp://h:6379"),
    ("resp://[::1]:7000", "resp://127.0.0.1:7000"),
    ("resp://127.0.0.2:7000", "resp://LOCALHOST.:7000"),
    ("resp://0.0.0.0:7000", "resp://localhost:7000"),
    ("resp://127.1:7000", "resp://localhost:7000"),
    ("resp://10.0.0.1:7000", "resp://0x0a.0.0.1:7000"),
    ("resp://[::ffff:10.0.0.1]:7000", "resp://10.0.0.1:7000"),
    ("resp://[2001:db8::1]:7000", "resp://[2001:DB8:0:0:0:0:0:1]:7000"),
    ("resp://Valkey.Example:7000", "rediss://valkey.example.:7000"),
    ("resp://:a@h:7000", "resp://user:b@h:7000/1"),  # another db of one server is the same server
]
DISTINCT = [
    ("resp://127.0.0.1:7000", "resp://127.0.0.1:7001"),
    ("resp://a:7000", "resp://b:7000"),
    ("resp://10.0.0.1:7000", "resp://host-of-10-0-0-1:7000"),  # no lookup: other names compare as spelled
    ("resp://10.0.0.1:7000", "resp://127.0.0.1:7000"),
]


@pytest.fixture
def no_dns(monkeypatch):
    """Any name lookup fails the test: parsing a config never waits on DNS."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a DNS lookup while parsing a config: {args}")

    for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getnameinfo"):
        monkeypatch.setattr(socket, name, refuse)


@pytest.mark.parametrize("a,b", SAME)
def test_the_vllm_connector_refuses_one_server_twice_in_a_rank(no_dns, a, b):
    with pytest.raises(ConnectorConfigError) as e:
        parse_settings({"urls": [[a, b]], "chunk_tokens": 64}, 1)
    msg = str(e.value)
    assert msg.startswith("kv_connector_extra_config.urls: instances 0 and 1 of rank 0 are one server") and "\n" not in msg
    # both spellings are named (passwords masked)
    assert a.replace(":a@", ":***@") in msg and b.replace(":b@", ":***@") in msg
    assert server_address(a) == server_address(b)


@pytest.mark.parametrize("a,b", SAME)
def test_the_lmcache_plugin_refuses_one_server_twice_in_a_rank(no_dns, a, b):
    with pytest.raises(PluginConfigError, match=r"^extra_config\.kvctl_remote_urls: instances 0 and 1 of rank 0 are one server"):
        plugin_settings({"kvctl_remote_urls": [[a, b]]}, "kvctl", 0)


@pytest.mark.parametrize("a,b", DISTINCT)
def test_distinct_servers_are_taken(no_dns, a, b):
    assert parse_settings({"urls": [[a, b]], "chunk_tokens": 64}, 1).instances_per_rank == 2
    assert plugin_settings({"kvctl_remote_urls": [[a, b]]}, "kvctl", 0).urls == (a, b)
    assert server_address(a) != server_address(b)


def test_ranks_may_not_share_an_instance_when_they_have_several(no_dns):
    urls = [["resp://127.0.0.1:7000", "resp://127.0.0.1:7001"], ["resp://localhost:7001", "resp://127.0.0.1:7002"]]
    with pytest.raises(ConnectorConfigError, match=r"rank 0 instance 1 and rank 1 instance 0 are one server"):
        parse_settings({"urls": urls, "chunk_tokens": 64}, 2)
    with pytest.raises(PluginConfigError, match=r"rank 0 instance 1 and rank 1 instance 0 are one server"):
        plugin_settings({"kvctl_remote_urls": urls}, "kvctl", 0)  # rank 0 refuses the shared list too
    # one instance per rank: one URL for every rank stays allowed (the documented plain-URL form)
    assert parse_settings({"urls": ["resp://127.0.0.1:7000", "resp://localhost:7000"], "chunk_tokens": 64}, 2)


def test_a_template_that_repeats_a_server_is_refused(no_dns):
    extra = {"remote_storage_plugin.kvctl.url": "resp://127.0.0.1:700{rank}",
             "remote_storage_plugin.kvctl.instances_per_rank": 2}
    with pytest.raises(PluginConfigError):  # no {instance}: refused before any address is compared
        plugin_settings(extra, "kvctl", 0)
    with pytest.raises(ConnectorConfigError, match="are one server"):
        parse_settings({"url": "resp://h:7000/{instance}", "instances_per_rank": 2, "chunk_tokens": 64},
                       1)  # db 0 and db 1 of one server


def test_deploy_valkey_engine_configs_refuse_one_server_twice():
    from kvctl.tier.lmcache_config import lmcache_config
    from kvctl.tier.vllm_config import kv_transfer_config

    urls = [["resp://127.0.0.1:7000", "resp://localhost:7000"]]
    with pytest.raises(InvalidInput, match="instances 0 and 1 of rank 0 are one server"):
        kv_transfer_config(urls, instances_per_rank=2)
    with pytest.raises(InvalidInput, match="instances 0 and 1 of rank 0 are one server"):
        lmcache_config(urls, plugin=True, instances_per_rank=2)
    ok = [["resp://127.0.0.1:7000", "resp://127.0.0.1:7001"]]
    assert kv_transfer_config(ok, instances_per_rank=2)["kv_connector_extra_config"]["urls"] == ok
