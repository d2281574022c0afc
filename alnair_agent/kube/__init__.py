"""kube: the agent's Kubernetes API side (client, pod watch, annotation writer, events, reflector).

Importing it installs the lazy kubernetes-asyncio packages (lazy_client.py) before any module here imports
kubernetes_asyncio: ~1000 API and model modules the agent never uses stay unloaded.
"""

from alnair_agent.kube import lazy_client

lazy_client.install()
