"""What a new user meets first: `alnair-agent --help` lists the variables, `--version`, a bad ALNAIR_SIM_GPUS gets
a sentence, the libraries' own log lines come out in the agent's JSON, and KUBECONFIG's files are merged as
kubectl merges them."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
from kubernetes_asyncio.client import CoreV1Api

from alnair_agent import logs
from alnair_agent.config import VARIABLES, ConfigError, Settings
from alnair_agent.kube.client import api_client, read_json
from alnair_agent.main import main


def test_help_lists_every_variable_and_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for v in VARIABLES:
        assert v.name in out
    assert "demo [--seconds N]" in out and "default 9475" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == "alnair-agent 0.1.0"


def test_a_bad_sim_gpus_gets_a_sentence() -> None:
    with pytest.raises(ConfigError) as e:
        Settings.from_env({"ALNAIR_NODE_NAME": "n", "ALNAIR_SIM_GPUS": "banana"})
    assert str(e.value) == ("ALNAIR_SIM_GPUS='banana' is not allowed; expected a comma-separated list of GPU memory "
                            "sizes, each [<count>x]<size> in MiB|GiB|TiB such as 2x16GiB or 16GiB,80GiB; 'banana' "
                            "is not one")


def test_the_metrics_port_is_not_dcgm_exporters() -> None:
    assert Settings(node_name="n").metrics_port != 9400
    assert Settings.from_env({"ALNAIR_NODE_NAME": "n"}).metrics_port == Settings(node_name="n").metrics_port


def test_library_logs_come_out_in_the_same_json() -> None:
    buf = io.StringIO()
    try:
        logs.configure("json", "info", buf)
        structlog.get_logger("alnair_agent").info("agent_event", n=1)
        logging.getLogger("aiohttp.access").warning("GET /metrics %s", 200)
        logging.getLogger("kubernetes_asyncio.config.kube_config").warning("Config not found: %s", "/nowhere")
        logging.getLogger("grpc.aio").debug("below the level: dropped")
        try:
            raise OSError("socket gone")
        except OSError:
            logging.getLogger("grpc._cython.cygrpc").exception("grpc trouble")
        lines = [json.loads(ln) for ln in buf.getvalue().splitlines()]  # every line is one JSON object
    finally:
        for h in [h for h in logging.getLogger().handlers if h.get_name() == "alnair"]:
            logging.getLogger().removeHandler(h)
    assert [ln["event"] for ln in lines] == ["agent_event", "GET /metrics 200", "Config not found: /nowhere",
                                              "grpc trouble"]
    assert {ln["level"] for ln in lines[1:]} == {"warning", "error"} and all("timestamp" in ln for ln in lines)
    assert lines[1]["logger"] == "aiohttp.access" and "OSError: socket gone" in lines[3]["exception"]


async def test_kubeconfig_files_are_merged_like_kubectl(tmp_path: Path) -> None:
    from alnair_standins.apiserver import FakeApiServer, make_pod

    async with FakeApiServer() as api:
        api.add_pod(make_pod("p", node="n"))
        # kubectl's rule: files merge, the first to define a name wins; here the context is in one file and the
        # cluster and user it names in another (the hand-written loader took the first file alone)
        first, second = tmp_path / "contexts", tmp_path / "clusters"
        first.write_text(f"apiVersion: v1\nkind: Config\ncurrent-context: ctx\n"
                         f"contexts: [{{name: ctx, context: {{cluster: stand-in, user: agent}}}}]\n"
                         f"clusters: [{{name: stand-in, cluster: {{server: \"{api.host}\"}}}}]\n")
        second.write_text("apiVersion: v1\nkind: Config\n"
                          "clusters: [{name: stand-in, cluster: {server: \"https://192.0.2.1:6443\"}}]\n"
                          "users: [{name: agent, user: {token: secret}}]\n")
        env = {"KUBECONFIG": f"{tmp_path / 'missing'}:{first}:{second}"}
        client = await api_client(Settings(node_name="n"), env)
        assert client is not None
        async with client:
            body = await read_json(await CoreV1Api(client).list_pod_for_all_namespaces(_preload_content=False))
        assert [p["metadata"]["name"] for p in body["items"]] == ["p"]
    assert "current-context: ctx" in first.read_text()  # never written back


def test_console_scripts_run() -> None:
    out = subprocess.run([sys.executable, "-m", "alnair_agent.main", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("alnair-agent ")


def test_install_shim_replaces_the_file_atomically(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from alnair_agent.shim_install import install_shim

    src = tmp_path / "new.so"
    src.write_bytes(b"\x7fELF new")
    host = tmp_path / "host-lib"
    host.mkdir()
    (host / "libalnair.so").write_bytes(b"\x7fELF old")
    with open(host / "libalnair.so", "rb") as mapped_by_a_running_container:
        assert install_shim(host, source=src) == 0
        assert mapped_by_a_running_container.read() == b"\x7fELF old"  # its inode lives on: renamed over, not rewritten
    assert (host / "libalnair.so").read_bytes() == b"\x7fELF new"
    assert sorted(p.name for p in host.iterdir()) == ["libalnair.so"]  # no temporary left behind
    assert (host / "libalnair.so").stat().st_mode & 0o777 == 0o755
    assert install_shim(tmp_path / "nowhere", source=src) == 1
    assert "is not a folder" in capsys.readouterr().err


def test_the_packaged_shim_is_installed_by_the_command(tmp_path: Path) -> None:
    assert main(["install-shim", str(tmp_path)]) == 0
    assert (tmp_path / "libalnair.so").read_bytes()[:4] == b"\x7fELF"
