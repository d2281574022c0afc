"""`alnair-scheduler`: the kube-scheduler HTTP extender (filter + prioritize) for Alnair's GPU-sharing resources.

`extender` holds the pure logic (ExtenderArgs JSON in, result JSON out), `server` the aiohttp app, `main` the CLI.
"""

# The scheduler's modules import kubernetes_asyncio before alnair_agent.kube: install the lazy packages first.
from alnair_agent.kube import lazy_client

lazy_client.install()
