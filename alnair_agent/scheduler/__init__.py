"""`alnair-scheduler`: the kube-scheduler HTTP extender (filter + prioritize) for Alnair's GPU-sharing resources.

`extender` holds the pure logic (ExtenderArgs JSON in, result JSON out), `server` the aiohttp app, `main` the CLI.
"""
