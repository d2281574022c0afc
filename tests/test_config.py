"""Configuration: every ALNAIR_* variable parsed in one place; a bad value is one clear line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from alnair_agent.config import (
    BUILD_VARIABLES,
    VARIABLES,
    ConfigError,
    Settings,
    build_markdown_table,
    markdown_table,
    parse_sim_gpus,
)

GIB = 1 << 30
BASE = {"ALNAIR_NODE_NAME": "node-1"}


def test_defaults():
    s = Settings.from_env(BASE)
    assert s.device_plugin_dir == Path("/var/lib/kubelet/device-plugins")
    assert s.workspace == Path("/var/lib/alnair/workspace")
    assert (s.gpu_backend, s.gpu_policy, s.kubernetes, s.log_format) == ("nvml", "binpack", "auto", "json")
    assert s.memory_unit_bytes == GIB
    assert [g.memory_bytes for g in s.sim_gpus] == [16 * GIB, 16 * GIB]


@pytest.mark.parametrize(("text", "sizes"), [
    ("2x16GiB", [16 * GIB] * 2),
    ("16GiB,80GiB", [16 * GIB, 80 * GIB]),
    ("1x512MiB,2x1TiB", [512 << 20, 1 << 40, 1 << 40]),
])
def test_sim_gpus(text, sizes):
    assert [g.memory_bytes for g in parse_sim_gpus(text)] == sizes


# Every variable, with a value it must refuse and a word the message must contain.
BAD_VALUES = [
    ("ALNAIR_NODE_NAME", "Node_1", "node name"),
    ("ALNAIR_DEVICE_PLUGIN_DIR", "relative/dir", "absolute path"),
    ("ALNAIR_POD_RESOURCES_SOCKET", "kubelet.sock", "absolute path"),
    ("ALNAIR_WORKSPACE", "ws", "absolute path"),
    ("ALNAIR_SHIM_DIR", "lib", "absolute path"),
    ("ALNAIR_GPU_BACKEND", "cuda", "nvml"),
    ("ALNAIR_SIM_GPUS", "2x16GB", "MiB|GiB|TiB"),
    ("ALNAIR_SIM_GPUS", "0x16GiB", "count >= 1"),
    ("ALNAIR_SIM_GPUS", "65x1GiB", "1..64"),
    ("ALNAIR_GPU_POLICY", "random", "binpack"),
    ("ALNAIR_PLACE_UNSCHEDULED", "yes", "true or false"),
    ("ALNAIR_MEMORY_UNIT_MIB", "0", "1..1048576"),
    ("ALNAIR_MEMORY_UNIT_MIB", "1.5", "integer"),
    ("ALNAIR_KUBERNETES", "on", "auto"),
    ("ALNAIR_METRICS_PORT", "70000", "0..65535"),
    ("ALNAIR_METRICS_PORT", "http", "integer"),
    ("ALNAIR_LOG_FORMAT", "xml", "json"),
    ("ALNAIR_LOG_LEVEL", "verbose", "debug"),
    ("ALNAIR_HEALTH_INTERVAL_S", "0", "0.05..60.0"),
    ("ALNAIR_RESYNC_INTERVAL_S", "soon", "number"),
    ("ALNAIR_PROFILE_INTERVAL_S", "0.01", "0.05..60.0"),
    ("ALNAIR_ANNOTATE_INTERVAL_S", "-1", "0.0..3600.0"),
    ("ALNAIR_MPS_PIPE_DIR", "nvidia-mps", "absolute path"),
    ("ALNAIR_MPS_SHM_DIR", "shm", "absolute path"),
    ("ALNAIR_SIM_TIMELINE_DIR", "timelines", "absolute path"),
    ("ALNAIR_SIM_FAULTS_FILE", "faults.json", "absolute path"),
    ("ALNAIR_DISPATCHER", "yes", "on"),
    ("ALNAIR_COMPUTE_POLICY", "greedy", "strict"),
    ("ALNAIR_DISPATCH_INTERVAL_S", "0.001", "0.01..1.0"),
    ("ALNAIR_TURN_PERIOD_S", "2", "0.005..1.0"),
    ("ALNAIR_TURN_PERIOD_S", "nan", "0.005..1.0"),
    ("ALNAIR_DISPATCH_IDLE_S", "0", "0.02..10.0"),
    ("ALNAIR_FRONTEND", "both", "device-plugin"),
    ("ALNAIR_DRA_PLUGIN_DIR", "plugins/alnair", "absolute path"),
    ("ALNAIR_PLUGINS_REGISTRY_DIR", "plugins_registry", "absolute path"),
    ("ALNAIR_CDI_DIR", "cdi", "absolute path"),
]


def test_every_variable_has_a_bad_value_case():
    assert {v.name for v in VARIABLES} == {name for name, _, _ in BAD_VALUES}


@pytest.mark.parametrize(("name", "value", "allowed"), BAD_VALUES)
def test_bad_value_names_variable_value_and_what_is_allowed(name, value, allowed):
    with pytest.raises(ConfigError) as err:
        Settings.from_env({**BASE, name: value})
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{name}={value!r}")
    assert allowed in message


def test_missing_node_name_and_unknown_variable():
    with pytest.raises(ConfigError, match="ALNAIR_NODE_NAME is not set"):
        Settings.from_env({})
    with pytest.raises(ConfigError, match="ALNAIR_GPU_POLCY is not a known setting"):
        Settings.from_env({**BASE, "ALNAIR_GPU_POLCY": "spread"})


def test_service_link_variables_are_not_settings():
    # kubelet adds these to every container in a namespace with a Service named "alnair-metrics".
    env = {**BASE, "ALNAIR_METRICS_SERVICE_HOST": "10.0.0.7", "ALNAIR_METRICS_SERVICE_PORT": "9400",
           "ALNAIR_METRICS_PORT_9400_TCP": "tcp://10.0.0.7:9400", "ALNAIR_METRICS_PORT_9400_TCP_ADDR": "10.0.0.7"}
    assert Settings.from_env(env).metrics_port == 9475  # the default, not dcgm-exporter's 9400


def test_readme_variable_table_is_generated_from_the_declaration():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = re.search(r"<!-- env-table -->\n(.*?)<!-- /env-table -->", readme, re.S)
    assert table, "README.md lacks the <!-- env-table --> block"
    assert table.group(1) == markdown_table(), "regenerate with: python -m alnair_agent.config --markdown"


# Names in the environment, and whether the agent starts with them: the build's own variables (exported in the shell
# that ran `pip install`) are known and ignored; any other ALNAIR_* name is a typo and stops it.
NAMES = [
    ({"ALNAIR_SHIM_CC": "cc"}, None),  # the README's host-compiler build
    ({"ALNAIR_SHIM_CC": "/usr/bin/gcc -O1"}, None),  # any value: the agent never reads it
    ({"ALNAIR_SHIM_CC": ""}, None),
    ({"ALNAIR_SHIM_CC": "cc", "ALNAIR_GPU_POLCY": "spread"}, "ALNAIR_GPU_POLCY is not a known setting"),
    ({"ALNAIR_SHIM_C": "cc"}, "ALNAIR_SHIM_C is not a known setting"),
    ({"ALNAIR_SHIMCC": "cc"}, "ALNAIR_SHIMCC is not a known setting"),
    ({"ALNAIR_SHIM_CC_": "cc"}, "ALNAIR_SHIM_CC_ is not a known setting"),
    ({"alnair_shim_cc": "cc"}, None),  # not an ALNAIR_* name: not the agent's
]


@pytest.mark.parametrize(("extra", "refused"), NAMES)
def test_build_variables_are_known_and_other_names_refused(extra, refused):
    env = {**BASE, **extra}
    if refused is None:
        assert Settings.from_env(env) == Settings.from_env(BASE)
    else:
        with pytest.raises(ConfigError, match=refused):
            Settings.from_env(env)


def test_every_build_variable_is_known_to_the_agent():
    for var in BUILD_VARIABLES:
        assert Settings.from_env({**BASE, var.name: "x"}) == Settings.from_env(BASE)
    assert not {v.name for v in BUILD_VARIABLES} & {v.name for v in VARIABLES}  # a build variable is no setting


def test_the_build_reads_only_the_declared_build_variables():
    # setup.py and the Makefiles it runs: every ALNAIR_* name they mention is one of BUILD_VARIABLES (so an agent
    # started from the same shell knows it), each declared one is the build's, and setup.py takes them from config.
    root = Path(__file__).parent.parent
    mentioned = set()
    for path in ("setup.py", "shim/Makefile", "tests/shim/simcuda/Makefile"):
        mentioned |= set(re.findall(r"\bALNAIR_[A-Z0-9_]+", (root / path).read_text()))
    declared = {v.name for v in BUILD_VARIABLES}
    assert mentioned <= declared, f"build variables not in config.BUILD_VARIABLES: {mentioned - declared}"
    assert declared <= mentioned, f"declared but no build reads them: {declared - mentioned}"
    assert "from alnair_agent.config import" in (root / "setup.py").read_text()


def test_readme_build_variable_table_is_generated_from_the_declaration():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = re.search(r"<!-- build-env-table -->\n(.*?)<!-- /build-env-table -->", readme, re.S)
    assert table, "README.md lacks the <!-- build-env-table --> block"
    assert table.group(1) == build_markdown_table(), "regenerate with: python -m alnair_agent.config --markdown-build"
