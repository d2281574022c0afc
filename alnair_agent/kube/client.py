"""The agent's Kubernetes API client: where it comes from, and reading raw JSON responses.

`api_client(settings)` picks the client by ALNAIR_KUBERNETES: `off` → None (no API server; the device plugin then
allocates without pod identity); `auto` → in-cluster configuration when KUBERNETES_SERVICE_HOST is set, else the
kubeconfig named by KUBECONFIG (several files, ':'-separated, merged by kubernetes-asyncio's own loader as kubectl
merges them: the first file to define a cluster, user or context wins; note that this loader, unlike kubectl, takes
`current-context` from the last file that sets it) or ~/.kube/config when one exists, else None with one warning.

The environment's proxy (HTTPS_PROXY / HTTP_PROXY for the API server's scheme, unless NO_PROXY exempts its host, as
client-go reads them) is looked up once, here. kubernetes-asyncio's session would look it up, and ~/.netrc, on every
request, each in a worker thread: two thread round trips per call, a millisecond of a DRA prepare's GET on a 2-core
node. A kubeconfig's own `proxy-url` wins, as in kubectl. (~/.netrc is not read: kubectl does not read it either.)
"""

from __future__ import annotations

import base64
import json
import os
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from alnair_agent.config import Settings

log = structlog.get_logger(__name__)

MERGE_PATCH = "application/merge-patch+json"


class KubeConfigError(RuntimeError):
    """The API server configuration was found but cannot be used (bad kubeconfig, missing service-account token)."""


def _kubeconfig_paths(env: Mapping[str, str]) -> str | None:
    """KUBECONFIG as kubectl reads it (':'-separated files, merged), else ~/.kube/config; None when no file exists.
    The loader (kubernetes-asyncio's KubeConfigMerger) takes the same string and merges the files that exist."""
    candidates = [p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p]
    home = env.get("HOME")
    if not candidates and home:
        candidates = [str(Path(home) / ".kube" / "config")]
    existing = [c for c in candidates if Path(c).expanduser().is_file()]
    return os.pathsep.join(existing) if existing else None


async def api_client(settings: Settings, env: Mapping[str, str] | None = None) -> ApiClient | None:
    """The ApiClient the agent uses, or None when it runs without an API server. Caller closes it."""
    return await connect(settings.kubernetes, env)


async def connect(mode: str, env: Mapping[str, str] | None = None) -> ApiClient | None:
    """An ApiClient by `mode` (`auto` | `off`, see the module doc), or None. Caller closes it."""
    env = os.environ if env is None else env
    if mode == "off":
        log.info("kubernetes_off")
        return None
    cfg = Configuration()
    if env.get("KUBERNETES_SERVICE_HOST"):
        try:
            kube_config.load_incluster_config(client_configuration=cfg, environ=dict(env))
        except ConfigException as e:
            raise KubeConfigError(f"in-cluster Kubernetes configuration unusable: {e}") from None
        log.info("kubernetes_in_cluster", host=cfg.host)
        return _client(cfg, env)
    path = _kubeconfig_paths(env)
    if path is not None:
        try:
            # persist_config=False: never write refreshed credentials back into the user's files
            await kube_config.load_kube_config(config_file=path, client_configuration=cfg, persist_config=False)
        except (ConfigException, OSError, ValueError) as e:
            raise KubeConfigError(f"kubeconfig {path} unusable: {e}") from None
        log.info("kubernetes_kubeconfig", path=path, host=cfg.host)
        return _client(cfg, env)
    log.warning("kubernetes_unavailable", message="running without an API server",
                hint="set KUBECONFIG, run in a pod, or ALNAIR_KUBERNETES=off")
    return None


def env_proxy(host: str, env: Mapping[str, str]) -> str | None:
    """The proxy `env` names for the API server at `host` (a URL), or None: `<scheme>_proxy` (lower case wins over
    upper, as in urllib and Go), unless `no_proxy` exempts the host."""
    proxies: dict[str, str] = {}
    for name in sorted(env, key=str.islower):  # upper case first, so that lower case overrides it
        if name.lower().endswith("_proxy") and env[name]:
            proxies[name.lower()[:-len("_proxy")]] = env[name]
    url = urllib.parse.urlsplit(host)
    if not url.hostname or url.scheme not in proxies:
        return None
    # Undocumented (so not in typeshed), but what urllib itself and requests decide no_proxy with.
    if urllib.request.proxy_bypass_environment(url.hostname, proxies):  # type: ignore[attr-defined]
        return None
    return proxies[url.scheme]


def _client(cfg: Configuration, env: Mapping[str, str]) -> ApiClient:
    if cfg.proxy is None:
        cfg.proxy = env_proxy(cfg.host, env)
    if cfg.proxy is not None:
        proxy = urllib.parse.urlsplit(cfg.proxy)
        if proxy.username is not None:  # credentials in the proxy URL: a header, as aiohttp makes of the environment's
            userinfo = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
            cfg.proxy_headers = {**(cfg.proxy_headers or {}),
                                 "Proxy-Authorization": "Basic " + base64.b64encode(userinfo.encode()).decode()}
            cfg.proxy = proxy._replace(netloc=proxy.netloc.rpartition("@")[2]).geturl()
        log.info("kubernetes_proxy", proxy=cfg.proxy)
    api = ApiClient(cfg)
    # The session kubernetes-asyncio made trusts the environment: a lookup of it (and of ~/.netrc) per request, in a
    # worker thread each. It is already read above.
    session = api.rest_client.pool_manager
    if getattr(session, "_trust_env", None) is True:
        session._trust_env = False
    return api


async def read_json(resp: aiohttp.ClientResponse) -> Any:
    """The JSON body of a response made with `_preload_content=False`; ApiException for a non-2xx status.

    The agent asks for raw responses so it works on the API's own JSON and never builds client models; the
    generated client only raises for errors when it preloads, so the status is checked here.
    """
    try:
        body = await resp.read()
    finally:
        resp.release()
    if not 200 <= resp.status <= 299:
        exc = ApiException(status=resp.status, reason=resp.reason)
        exc.body = body.decode("utf-8", "replace")  # type: ignore[assignment]  # the text, as the library sets it
        raise exc
    try:
        return json.loads(body)
    except ValueError as e:
        raise ApiException(status=resp.status, reason=f"response is not JSON: {e}") from None
