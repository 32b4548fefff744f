"""``kvpool-mooncake-store`` beside Mooncake's own wheel: ``mooncake.store`` is kvpool's, while
``mooncake.engine`` (the real TransferEngine), the wheel's pure-Python modules and
vllm-ascend's ``GlobalTE`` (which builds the TransferEngine its P/D connectors use) stay
Mooncake's.

The Mooncake wheel (``mooncake-transfer-engine-non-cuda`` 0.3.13.post1) and the hook package are
installed into a directory that a child process adds as a site directory (so the hook's
``.pth`` runs, as in site-packages). Skipped, with the reason, only when PyPI is unreachable or
the wheel's native libraries cannot load on this machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import install_mooncake_beside_kvpool

HERE = Path(__file__).parent
VLLM_ASCEND = "vllm-ascend==0.23.0"
TE_FILE = "vllm_ascend/distributed/kv_transfer/utils/mooncake_transfer_engine.py"


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("coexist-site")
    install_mooncake_beside_kvpool(site)
    assert (site / "kvpool_mooncake_store.pth").is_file()
    src = tmp_path_factory.mktemp("vllm-ascend")
    unpack = subprocess.run([sys.executable, str(HERE / "wheels.py"), VLLM_ASCEND, str(src),
                             TE_FILE], capture_output=True, text=True, timeout=900,
                            stdin=subprocess.DEVNULL)
    if unpack.returncode == 3:
        pytest.skip(unpack.stdout.strip())
    assert unpack.returncode == 0, unpack.stdout + unpack.stderr
    (site / "vllm_ascend_te.py").write_text((src / TE_FILE).read_text())
    return site


SCRIPT = """
import json, os, site, sys
site.addsitedir({site!r})
try:
    from mooncake.engine import TransferEngine
except (ImportError, OSError) as exc:
    print("SKIP the wheel's native engine does not load here:", exc)
    raise SystemExit(0)
import mooncake, mooncake.store, mooncake.structured_object_store as sos, vllm_ascend_te
result = {{"store": getattr(mooncake.store, "BACKEND", "mooncake"),
          "store_class": mooncake.store.MooncakeDistributedStore.__module__,
          "engine_class": TransferEngine.__module__,
          "package": os.path.dirname(mooncake.__file__),
          "wheel_modules_see_kvpool": sos._mooncake_store is mooncake.store}}
engine = TransferEngine()
result["engine_tcp"] = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
try:  # vllm-ascend's P/D connectors build their engine here (protocol ascend)
    vllm_ascend_te.global_te.get_transfer_engine("127.0.0.1", None)
except RuntimeError:  # a wheel without the Ascend transport may refuse it: still its engine
    pass
result["global_te_engine"] = type(vllm_ascend_te.global_te.transfer_engine) is TransferEngine
store = mooncake.store.MooncakeDistributedStore()
result["setup"] = store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                              {master!r})
result["put"] = store.put("coexist-key", b"bytes through kvpool")
result["get"] = store.get("coexist-key").decode()
store.close()
print("RESULT " + json.dumps(result), flush=True)
"""


def test_store_is_kvpools_and_the_engine_stays_mooncakes(site_dir: Path, master: Any) -> None:
    proc = subprocess.run([sys.executable, "-c",
                           textwrap.dedent(SCRIPT.format(site=str(site_dir),
                                                         master=master.address))],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    skip = [line for line in proc.stdout.splitlines() if line.startswith("SKIP ")]
    if skip:
        pytest.skip(skip[0][5:])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["store"] == "kvpool"
    assert result["store_class"].startswith("kvpool_client.")
    assert result["engine_class"] == "mooncake.engine"  # the wheel's own engine
    assert result["package"] == str(site_dir / "mooncake")  # the wheel's own package
    assert result["wheel_modules_see_kvpool"] is True
    assert result["engine_tcp"] == 0
    assert result["global_te_engine"] is True
    assert result["setup"] == 0 and result["put"] == 0
    assert result["get"] == "bytes through kvpool"


def test_the_hook_can_be_turned_off_for_one_process(site_dir: Path) -> None:
    script = (f"import site; site.addsitedir({str(site_dir)!r})\n"
              "try:\n    import mooncake.store as s\n"
              "except (ImportError, OSError) as exc:\n    print('SKIP', exc); raise SystemExit\n"
              "print('RESULT', getattr(s, 'BACKEND', 'mooncake'))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env={"KVPOOL_MOONCAKE_STORE": "mooncake",
                                           "PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL)
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.stdout.strip() == "RESULT mooncake", proc.stdout + proc.stderr
