"""`alnair-agent demo`: the real agent, shim and dispatcher on one machine against the stand-ins of the outside
world (alnair_standins): `run.py` (the command: both runs), `device_plugin.py` and `dra.py` (one front-end each),
`common.py` (the workloads, the table, a container's environment)."""
