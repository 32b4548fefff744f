"""ClientConfig: Mooncake-compatible JSON, kvpool keys, environment sources, clear errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvpool_client import config as config_module
from kvpool_client.config import ClientConfig, ConfigError
from kvpool_wire.status import KVPoolError, Status

MINDIE_JSON = {
    "local_hostname": "localhost",
    "metadata_server": "P2PHANDSHAKE",
    "global_segment_size": 268435456,
    "protocol": "ascend",
    "device_name": "",
    "master_server_address": "master_server_ip:50051",
    "use_ascend_direct": True,
}


def write(tmp_path: Path, values: object, name: str = "client.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(values))
    return str(path)


def test_every_field_has_exactly_one_parser() -> None:
    assert set(config_module._PARSERS) == {f.name for f in dataclasses.fields(ClientConfig)}


def test_mindie_seed_file_loads_verbatim(tmp_path: Path) -> None:
    config = ClientConfig.from_file(write(tmp_path, MINDIE_JSON), environ={})
    assert config.local_hostname == "localhost"
    assert config.global_segment_size == 268435456
    assert config.protocol == "ascend"
    assert config.master_server_address == "master_server_ip:50051"
    assert config.use_ascend_direct is True
    assert config.transport == "auto"  # untouched kvpool keys keep their defaults


def test_size_strings_and_all_kvpool_keys(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    values = {
        "local_hostname": "10.0.0.5:17000",
        "global_segment_size": "4gb",
        "local_buffer_size": "512 MiB",
        "protocol": "TCP",
        "master_server_address": "127.0.0.1:50051",
        "preferred_segment": "seg-1",
        "prefer_alloc_in_same_node": True,
        "replica_num": 2,
        "transport": "tcp",
        "heartbeat_interval_s": 0.5,
        "rpc_timeout_s": 2,
        "transfer_timeout_s": "7.5",
        "checksum": True,
        "metrics_port": 0,
        "cluster_id": "prod-a",
        "auth_token": "secret",
        "tls_ca": str(ca),
        "use_fast_path": False,
        "async_write_queue_size": 64,
        "max_segment_size": "1gb",
        "commit_nowait": False,
        "busy_poll_us": 0,
    }
    config = ClientConfig.from_dict(values)
    assert config.global_segment_size == 4 * 2**30
    assert config.local_buffer_size == 512 * 2**20
    assert config.protocol == "tcp"
    assert config.transfer_timeout_s == 7.5
    assert config.rpc_timeout_s == 2.0
    assert config.max_segment_size == 2**30
    assert config.tls_ca == str(ca)
    assert config.data_host == "10.0.0.5"
    assert (config.checksum, config.use_fast_path, config.commit_nowait) == (True, False, False)
    assert config.busy_poll_us == 0


def test_known_mooncake_keys_are_ignored_silently() -> None:
    config = ClientConfig.from_dict({"rdma_devices": "mlx5_0", "master_metrics_port": 9003,
                                     "check_server": False})
    assert config == ClientConfig()


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"global_segment_szie": 1}, "unknown key 'global_segment_szie' (did you mean "
                                     "'global_segment_size'?)"),
        ({"zzz": 1}, "unknown key 'zzz'"),
        ({"global_segment_size": "4 elephants"}, "key 'global_segment_size': not a size"),
        ({"global_segment_size": -1}, "key 'global_segment_size': size must be >= 0"),
        ({"local_buffer_size": True}, "key 'local_buffer_size'"),
        ({"protocol": "udp"}, "key 'protocol': must be one of tcp, rdma, ascend"),
        ({"transport": "rdma"}, "key 'transport': must be one of auto, shm, tcp"),
        ({"master_server_address": "nohost"}, "key 'master_server_address': expected 'host:port'"),
        ({"master_server_address": "h:99999"}, "key 'master_server_address'"),
        ({"local_hostname": ""}, "key 'local_hostname': must not be empty"),
        ({"checksum": "yes"}, "key 'checksum': expected true, false or \"auto\""),
        ({"rpc_timeout_s": 0}, "key 'rpc_timeout_s': must be > 0 seconds"),
        ({"heartbeat_interval_s": float("nan")}, "key 'heartbeat_interval_s'"),
        ({"metrics_port": 70000}, "key 'metrics_port': must be between -1 and 65535"),
        ({"async_write_queue_size": 0}, "key 'async_write_queue_size'"),
        ({"busy_poll_us": -5}, "key 'busy_poll_us': must be between 0 and 100000"),
        ({"busy_poll_us": 1.5}, "key 'busy_poll_us'"),
        ({"copy_threads": 65}, "key 'copy_threads': must be between 0 and 64"),
        ({"cluster_id": "a/b"}, "key 'cluster_id'"),
        ({"tls_ca": "/nonexistent/ca.pem"}, "key 'tls_ca': file '/nonexistent/ca.pem' does not"),
        ({"tls_key": __file__}, "'tls_cert' and 'tls_key' must be given together"),
        ({"protocol": "ascend_no_transport", "global_segment_size": 1},
         "must be 0 with protocol 'ascend_no_transport'"),
        ({"data_port": "14300-12300"}, "key 'data_port': expected 0, a port or \"low-high\""),
        ({"data_port": "0-5"}, "key 'data_port': must be between 1 and 65535"),
        ({"data_port": 70000}, "key 'data_port': must be between 0 and 65535"),
        ({"data_port": "twelve"}, "key 'data_port': expected an integer"),
        ({"data_port": True}, "key 'data_port': expected an integer"),
    ],
)
def test_bad_values_name_the_key_and_the_problem(values: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        ClientConfig.from_dict(values)
    assert fragment in str(info.value)
    assert info.value.status == Status.INVALID_ARGUMENT
    assert isinstance(info.value, KVPoolError) and isinstance(info.value, ValueError)


def test_scheduler_role_contributes_nothing() -> None:
    config = ClientConfig.from_dict({"protocol": "ascend_no_transport", "global_segment_size": 0,
                                     "local_buffer_size": 0})
    assert config.global_segment_size == 0


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
    ],
)
def test_bad_files_say_what_is_wrong(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment) as info:
        ClientConfig.from_file(path, environ={})
    assert str(path) in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        ClientConfig.from_file(tmp_path / "absent.json", environ={})


def test_error_in_file_names_file_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, {**MINDIE_JSON, "protocol": "carrier-pigeon"})
    with pytest.raises(ConfigError) as info:
        ClientConfig.from_file(path, environ={})
    assert path in str(info.value) and "'protocol'" in str(info.value)


def test_env_overrides_beat_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, MINDIE_JSON)
    env = {"MOONCAKE_MASTER": "127.0.0.1:6000", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1gb",
           "MOONCAKE_LOCAL_BUFFER_SIZE": "1048576", "MOONCAKE_PROTOCOL": "tcp"}
    config = ClientConfig.from_file(path, environ=env)
    assert config.master_server_address == "127.0.0.1:6000"
    assert config.global_segment_size == 2**30
    assert config.local_buffer_size == 2**20
    assert config.protocol == "tcp"


def test_bad_env_override_names_the_variable(tmp_path: Path) -> None:
    path = write(tmp_path, MINDIE_JSON)
    with pytest.raises(ConfigError, match="MOONCAKE_GLOBAL_SEGMENT_SIZE .*global_segment_size"):
        ClientConfig.from_file(path, environ={"MOONCAKE_GLOBAL_SEGMENT_SIZE": "lots"})


def test_from_env_prefers_kvpool_path(tmp_path: Path) -> None:
    kv = write(tmp_path, {"master_server_address": "127.0.0.1:1111"}, "kv.json")
    mc = write(tmp_path, {"master_server_address": "127.0.0.1:2222"}, "mc.json")
    both = {"KVPOOL_CONFIG_PATH": kv, "MOONCAKE_CONFIG_PATH": mc}
    assert ClientConfig.from_env(both).master_server_address == "127.0.0.1:1111"
    only_mc = {"MOONCAKE_CONFIG_PATH": mc}
    assert ClientConfig.from_env(only_mc).master_server_address == "127.0.0.1:2222"


def test_from_env_without_a_file(tmp_path: Path) -> None:
    config = ClientConfig.from_env({"MOONCAKE_MASTER": "127.0.0.1:7777",
                                    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "64mb"})
    assert config.master_server_address == "127.0.0.1:7777"
    assert config.global_segment_size == 64 * 2**20
    with pytest.raises(ConfigError, match="KVPOOL_CONFIG_PATH"):
        ClientConfig.from_env({})


def test_replace_validates() -> None:
    config = ClientConfig().replace(transport="tcp", global_segment_size="2mb")
    assert (config.transport, config.global_segment_size) == ("tcp", 2 * 2**20)
    with pytest.raises(ConfigError, match="'transport'"):
        ClientConfig().replace(transport="pigeon")


def test_data_port_forms() -> None:
    assert ClientConfig().data_port == (0, 0)   # any free port
    for raw, parsed in ((0, (0, 0)), (13000, (13000, 13000)), ("13000", (13000, 13000)),
                        ("12300-14300", (12300, 14300)), (" 5-5 ", (5, 5)), ([7, 9], (7, 9))):
        config = ClientConfig.from_dict({"data_port": raw})
        assert config.data_port == parsed
        assert config.replace().data_port == parsed   # survives a round trip


def test_data_host_forms() -> None:
    assert ClientConfig(local_hostname="127.0.0.1").data_host == "127.0.0.1"
    assert ClientConfig(local_hostname="node7:8790").data_host == "node7"
    assert ClientConfig(local_hostname="[::1]:8790").data_host == "::1"
    assert ClientConfig(local_hostname="::1").data_host == "::1"


def test_config_is_frozen() -> None:
    config = ClientConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.transport = "tcp"  # type: ignore[misc]


def test_config_path_env_names_are_the_documented_ones() -> None:
    assert config_module.CONFIG_PATH_ENVS == ("KVPOOL_CONFIG_PATH", "MOONCAKE_CONFIG_PATH")
    assert set(config_module.ENV_OVERRIDES) == {"MOONCAKE_MASTER", "MOONCAKE_GLOBAL_SEGMENT_SIZE",
                                                "MOONCAKE_LOCAL_BUFFER_SIZE", "MOONCAKE_PROTOCOL",
                                                "MC_STORE_USE_HUGEPAGE",
                                                "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
                                                "MOONCAKE_LOCAL_HOSTNAME",
                                                "MOONCAKE_TE_META_DATA_SERVER", "MOONCAKE_DEVICE"}


def test_the_host_peers_reach_comes_from_the_environment(tmp_path: Path) -> None:
    """One file for every worker; each pod's address from its environment."""
    path = write(tmp_path, {**MINDIE_JSON, "local_hostname": "127.0.0.1"})
    config = ClientConfig.from_file(path, environ={"MOONCAKE_LOCAL_HOSTNAME": "10.1.2.3",
                                                   "MOONCAKE_DEVICE": "mlx5_0"})
    assert (config.local_hostname, config.data_host, config.device_name) == \
        ("10.1.2.3", "10.1.2.3", "mlx5_0")
    assert ClientConfig.from_file(path, environ={}).local_hostname == "127.0.0.1"


def test_huge_pages_and_populate_keys(tmp_path: Path) -> None:
    assert (ClientConfig().use_hugepage, ClientConfig().populate_peer_segments) == (False, True)
    path = write(tmp_path, {**MINDIE_JSON, "populate_peer_segments": False})
    config = ClientConfig.from_file(path, environ={"MC_STORE_USE_HUGEPAGE": "1"})
    assert (config.use_hugepage, config.populate_peer_segments) == (True, False)
    with pytest.raises(ConfigError, match="MC_STORE_USE_HUGEPAGE .*use_hugepage"):
        ClientConfig.from_file(path, environ={"MC_STORE_USE_HUGEPAGE": "plenty"})


def test_vllm_ascend_mooncake_json_is_accepted() -> None:
    from kvpool_client.config import ClientConfig

    config = ClientConfig.from_dict({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
        "master_server_address": "127.0.0.1:50051", "protocol": "ascend",
        "global_segment_size": "1gb", "preferred_segment": True,
        "enable_ssd_offload": False, "ssd_offload_path": "/tmp/x"})
    assert config.preferred_segment == ""
    assert config.global_segment_size == 1 << 30


@pytest.mark.parametrize(("local", "master", "unreachable"), [
    ("127.0.0.1", "10.0.0.1:50051", True),
    ("localhost:8790", "kvpool-master:50051", True),
    ("[::1]:8790", "[2001:db8::1]:50051", True),
    ("0.0.0.0", "10.0.0.1:50051", True),            # handed to a peer: the peer itself
    ("127.0.0.1", "127.0.0.1:50051", False),        # everything on one host
    ("10.0.0.7", "10.0.0.1:50051", False),
    ("node7", "kvpool-master:50051", False),        # a name: it may resolve anywhere
])
def test_a_loopback_address_with_a_remote_master_is_named(local: str, master: str,
                                                          unreachable: bool) -> None:
    config = ClientConfig(local_hostname=local, master_server_address=master)
    reason = config.unreachable_by_peers()
    assert bool(reason) == unreachable
    if unreachable:
        assert "MOONCAKE_LOCAL_HOSTNAME" in reason and master in reason
