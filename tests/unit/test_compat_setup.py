"""``setup`` argument forms, return-code mapping and ReplicateConfig translation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool_client.compat import codes
from kvpool_client.compat.replicate import ReplicateConfig, put_options
from kvpool_client.compat.setup_args import host_of, parse_setup
from kvpool_client.config import ConfigError
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Pin, PutOptions

NO_ENV: dict[str, str] = {}


def test_mindie_eight_positional_arguments() -> None:
    engine = object()
    setup = parse_setup(("10.0.0.7:17001", "P2PHANDSHAKE", 268435456, "1gb", "ascend", "",
                         "127.0.0.1:12345", engine), {}, NO_ENV)
    assert setup.segment_name == "10.0.0.7:17001"
    assert setup.engine is engine
    config = setup.config
    assert config.local_hostname == "10.0.0.7"
    assert config.global_segment_size == 268435456
    assert config.local_buffer_size == 1 << 30  # the raw JSON value may be a size string
    assert config.protocol == "ascend"
    assert config.master_server_address == "127.0.0.1:12345"


def test_mindie_scheduler_and_non_direct_forms() -> None:
    scheduler = parse_setup(("10.0.0.7:17001", "P2PHANDSHAKE", 0, 0, "ascend_no_transport", "",
                             "127.0.0.1:12345", None), {}, NO_ENV)
    assert scheduler.config.global_segment_size == 0
    assert scheduler.config.protocol == "ascend_no_transport"
    non_direct = parse_setup(("10.0.0.7:8793:npu_3", "P2PHANDSHAKE", 1 << 20, 1 << 20, "ascend",
                              "", "127.0.0.1:12345"), {}, NO_ENV)
    assert non_direct.config.local_hostname == "10.0.0.7"
    assert non_direct.segment_name == "10.0.0.7:8793:npu_3"
    assert non_direct.engine is None


def test_keyword_form_as_vllm_ascend_calls_it() -> None:
    setup = parse_setup((), dict(local_hostname="127.0.0.1:4000", metadata_server="P2PHANDSHAKE",
                                 global_segment_size=1 << 30, local_buffer_size=1 << 30,
                                 protocol="ascend", rdma_devices="",
                                 master_server_addr="127.0.0.1:50051", engine=None), NO_ENV)
    assert setup.config.global_segment_size == 1 << 30
    assert setup.config.master_server_address == "127.0.0.1:50051"


def test_mooncake_huge_page_switch_is_read_from_the_environment() -> None:
    args = ("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", "127.0.0.1:50051")
    assert parse_setup(args, {}, NO_ENV).config.use_hugepage is False
    assert parse_setup(args, {}, {"MC_STORE_USE_HUGEPAGE": "1"}).config.use_hugepage is True
    assert parse_setup(args, {}, {"MC_STORE_USE_HUGEPAGE": "false"}).config.use_hugepage is False
    with pytest.raises(ConfigError, match="MC_STORE_USE_HUGEPAGE"):
        parse_setup(args, {}, {"MC_STORE_USE_HUGEPAGE": "please"})


def test_the_default_tenant_is_accepted_in_either_form() -> None:
    for args, kwargs in ((("h", "P2PHANDSHAKE"), {"tenant_id": "default"}),
                         (({"local_hostname": "h", "metadata_server": "P",
                            "tenant_id": "default"},), {})):
        assert parse_setup(args, kwargs, NO_ENV).config.local_hostname == "h"


def test_dict_form_accepts_both_master_spellings() -> None:
    for key in ("master_server_addr", "master_server_address"):
        setup = parse_setup(({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                              "global_segment_size": "64mb", "protocol": "tcp",
                              key: "127.0.0.1:7000"},), {}, NO_ENV)
        assert setup.config.master_server_address == "127.0.0.1:7000"
        assert setup.config.global_segment_size == 64 << 20
        assert setup.config.local_buffer_size == 16 << 20  # Mooncake's default


def test_dict_form_as_vllm_store_connector_passes_it(caplog: pytest.LogCaptureFixture) -> None:
    # every value a string, and a key of vLLM's own beside Mooncake's: as Mooncake does, the
    # known keys are read and the other one is ignored (a warning names it)
    setup = parse_setup(({"local_hostname": "10.0.0.7", "metadata_server": "P2PHANDSHAKE",
                          "global_segment_size": str(4 << 30), "local_buffer_size": "1073741824",
                          "protocol": "tcp", "rdma_devices": "",
                          "master_server_addr": "10.0.0.1:50051",
                          "enable_offload": "true"},), {}, NO_ENV)
    assert setup.config.global_segment_size == 4 << 30
    assert setup.config.local_buffer_size == 1 << 30
    assert setup.config.master_server_address == "10.0.0.1:50051"
    assert "enable_offload" in caplog.text


@pytest.mark.parametrize("text,flag", [("true", True), ("True", True), ("1", True),
                                       ("false", False), ("False", False), ("0", False)])
def test_dict_form_reads_flags_given_as_text(tmp_path: Path, text: str, flag: bool) -> None:
    setup = parse_setup(({"local_hostname": "h", "metadata_server": "P",
                          "enable_ssd_offload": text, "ssd_offload_path": str(tmp_path)},), {},
                        NO_ENV)
    assert setup.config.enable_ssd_offload is flag


@pytest.mark.parametrize("args,kwargs,fragment", [
    (("h",), {}, "metadata_server"),
    (("h", "P2PHANDSHAKE", -1), {}, "global_segment_size"),
    (("h", "P2PHANDSHAKE", 1, 1, "carrier-pigeon"), {}, "protocol"),
    (("h", "P2PHANDSHAKE", 1, 1, "tcp", "", "no-port"), {}, "master_server_address"),
    (("h", "P2PHANDSHAKE"), {"bogus": 1}, "bogus"),
    (("h", "P2PHANDSHAKE"), {"metadata_server": "x"}, "twice"),
    (("h", "P2PHANDSHAKE"), {"enable_ssd_offload": True}, "ssd_offload_path"),
    (("h", "P2PHANDSHAKE"), {"enable_ssd_offload": 1}, "enable_ssd_offload"),
    (({"local_hostname": "h"},), {}, "metadata_server"),
    (({"local_hostname": "h", "metadata_server": "P", "enable_ssd_offload": "maybe"},), {},
     "enable_ssd_offload"),
    ((7, "P2PHANDSHAKE"), {}, "local_hostname"),
    (("h", "P2PHANDSHAKE", 1, 1, "ascend_no_transport"), {}, "ascend_no_transport"),
    # one key space: another tenant's objects would answer under the same keys
    (("h", "P2PHANDSHAKE"), {"tenant_id": "team-a"}, "tenant_id 'team-a'"),
    (({"local_hostname": "h", "metadata_server": "P", "tenant_id": "b"},), {}, "tenant_id 'b'"),
])
def test_bad_setup_arguments_name_the_problem(args: tuple, kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_setup(args, kwargs, NO_ENV)
    assert fragment in str(info.value)
    assert info.value.status == Status.INVALID_ARGUMENT


def test_kvpool_config_file_is_the_base_and_setup_overrides_it(tmp_path: Path) -> None:
    path = tmp_path / "kvpool.json"
    path.write_text(json.dumps({"auth_token": "s3cret", "transport": "tcp",
                                "master_server_address": "127.0.0.1:1111"}))
    setup = parse_setup(("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 0, "tcp", "", "127.0.0.1:2222"),
                        {}, {"KVPOOL_CONFIG_PATH": str(path)})
    assert setup.config.auth_token == "s3cret"
    assert setup.config.transport == "tcp"
    assert setup.config.master_server_address == "127.0.0.1:2222"


@pytest.mark.parametrize("text,host", [
    ("10.1.2.3", "10.1.2.3"), ("10.1.2.3:17001", "10.1.2.3"), ("node-1:8790:npu_0", "node-1"),
    ("[::1]:9000", "::1"), ("::1", "::1"), ("localhost", "localhost"),
])
def test_host_of_strips_mooncake_segment_suffixes(text: str, host: str) -> None:
    assert host_of(text) == host


def test_codes_pass_mooncake_numbers_through_and_map_kvpool_only_ones() -> None:
    for status in (Status.OK, Status.NO_SPACE, Status.INVALID_ARGUMENT, Status.NOT_FOUND,
                   Status.HAS_LEASE, Status.LEASE_EXPIRED, Status.TRANSFER_FAILED,
                   Status.RPC_FAILED, Status.INVALID_KEY, Status.NOT_READY):
        assert codes.mooncake_code(status) == int(status)
    for status in Status:
        code = codes.mooncake_code(status)
        assert code == 0 or -1000 < code < 0, status  # only Mooncake's own numbers leave
    assert codes.mooncake_code(-12345) == codes.INTERNAL_ERROR
    assert codes.code_of_error(KVPoolError(Status.TIMEOUT)) == codes.TRANSFER_FAILED
    assert codes.code_of_error(RuntimeError("x")) == codes.INTERNAL_ERROR


def test_replicate_config_translation() -> None:
    assert put_options(None, str) is None
    config = ReplicateConfig()
    config.preferred_segment = "10.0.0.7:17001"
    config.prefer_alloc_in_same_node = True
    options = put_options(config, lambda name: {"10.0.0.7:17001": "seg-0"}.get(name, name))
    assert options == PutOptions(replica_num=1, preferred_segment="seg-0",
                                 prefer_same_host=True, pin=Pin.NONE)
    pinned = ReplicateConfig(replica_num=2, with_soft_pin=True)
    assert put_options(pinned, str) == PutOptions(replica_num=2, pin=Pin.SOFT)
    assert put_options(ReplicateConfig(with_hard_pin=True, with_soft_pin=True), str).pin == \
        Pin.HARD
    with pytest.raises(AttributeError):
        config.prefered_segment = "typo"  # type: ignore[attr-defined]
    for bad in (ReplicateConfig(replica_num=0), ReplicateConfig(preferred_segment=5)):  # type: ignore[arg-type]
        with pytest.raises(KVPoolError) as info:
            put_options(bad, str)
        assert info.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KVPoolError):
        put_options({"replica_num": 1}, str)  # type: ignore[arg-type]
