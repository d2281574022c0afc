"""The mutating admission webhook of `alnair-scheduler`: POST /mutate, AdmissionReview admission.k8s.io/v1, HTTPS.

Two rules, for pods being created:
- **Route.** A pod that asks for `alnair/*` in any container (limits or requests) gets `spec.schedulerName` set to
  an Alnair profile: the one its `ai.centaurus.io/profile` annotation names (`cost-saving` or `high-performance`,
  with or without the `alnair-` prefix), else the configured default. Without this a pod that keeps the default
  scheduler skips the extender, and the agent refuses it at admission. A pod asking for no `alnair/*` is untouched.
- **Refuse.** A pod of which a container (init and ephemeral ones included) sets `NVIDIA_VISIBLE_DEVICES`,
  `LD_PRELOAD` or any `ALNAIR_*` variable is denied: those are what the agent's Allocate hands a container (which
  GPU it sees, the shim, its limits), and a pod that sets them itself can see GPUs it was not given or run without
  the shim. The webhook configuration leaves out kube-system (the agent and NVIDIA's own pods set
  `NVIDIA_VISIBLE_DEVICES` there) and namespaces labelled `alnair.centaurus.io/webhook=disabled`.

`review` is pure (dict in, dict out) and never raises; TLS (a Secret's files, or a self-signed certificate whose CA
goes into the MutatingWebhookConfiguration's caBundle) is set up by `tls_context` and `publish_ca_bundle`.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from alnair_agent.scheduler.extender import PROFILES

log = structlog.get_logger(__name__)

PROFILE_ANNOTATION = "ai.centaurus.io/profile"
RESOURCE_PREFIX = "alnair/"
FORBIDDEN_ENV = ("NVIDIA_VISIBLE_DEVICES", "LD_PRELOAD")
FORBIDDEN_ENV_PREFIX = "ALNAIR_"
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")
WEBHOOK_CONFIGURATION = "alnair-scheduler"


@dataclass(frozen=True)
class Decision:
    allowed: bool
    message: str = ""
    patch: tuple[dict[str, Any], ...] = ()


def profile_of(name: str) -> str | None:
    """'cost-saving', 'alnair-cost-saving' -> 'alnair-cost-saving'; None for anything else."""
    name = name.strip()
    full = name if name.startswith("alnair-") else f"alnair-{name}"
    return full if full in PROFILES else None


def _map(value: Any) -> Mapping[str, Any]:
    """The value if it is a JSON object, else an empty one: the pod comes from the API server, but any field may
    hold anything, and the answer must never be the internal-error path."""
    return value if isinstance(value, Mapping) else {}


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _containers(spec: Mapping[str, Any]) -> Iterable[tuple[str, Mapping[str, Any]]]:
    for key in CONTAINER_LISTS:
        for c in _items(spec.get(key)):
            if isinstance(c, Mapping):
                yield key, c


def asks_for_alnair(pod: Mapping[str, Any]) -> bool:
    for _, c in _containers(_map(pod.get("spec"))):
        resources = _map(c.get("resources"))
        for section in ("limits", "requests"):
            if any(str(k).startswith(RESOURCE_PREFIX) for k in _map(resources.get(section))):
                return True
    return False


def forbidden_env(pod: Mapping[str, Any]) -> list[str]:
    """'container/VARIABLE' for every variable a container sets that only the agent may set."""
    found = []
    for _, c in _containers(_map(pod.get("spec"))):
        for e in _items(c.get("env")):
            name = str(_map(e).get("name", ""))
            if name in FORBIDDEN_ENV or name.startswith(FORBIDDEN_ENV_PREFIX):
                found.append(f"{c.get('name', '?')}/{name}")
        for source in _items(c.get("envFrom")):  # the keys of a ConfigMap or Secret are not in the pod: the prefix is
            prefix = str(_map(source).get("prefix", ""))
            names = (*FORBIDDEN_ENV, FORBIDDEN_ENV_PREFIX)
            if prefix and (prefix.startswith(FORBIDDEN_ENV_PREFIX) or any(n.startswith(prefix) for n in names)):
                found.append(f"{c.get('name', '?')}/envFrom prefix {prefix}")
    return found


def decide(pod: Mapping[str, Any], default_profile: str) -> Decision:
    """What the webhook does with a pod being created."""
    bad = forbidden_env(pod)
    if bad:
        return Decision(False, "alnair: containers may not set NVIDIA_VISIBLE_DEVICES, LD_PRELOAD or ALNAIR_* "
                               "(the Alnair agent sets them for the GPU slice it allocates); found "
                               + ", ".join(bad))
    if not asks_for_alnair(pod):
        return Decision(True)
    annotations = _map(_map(pod.get("metadata")).get("annotations"))
    wanted = annotations.get(PROFILE_ANNOTATION)
    if wanted is not None:
        profile = profile_of(str(wanted))
        if profile is None:
            return Decision(False, f"alnair: annotation {PROFILE_ANNOTATION}={wanted!r} names no profile; allowed: "
                                   + ", ".join(p.removeprefix("alnair-") for p in PROFILES))
    else:
        current = _map(pod.get("spec")).get("schedulerName")
        profile = current if isinstance(current, str) and current in PROFILES else default_profile
    spec = _map(pod.get("spec"))
    if spec.get("schedulerName") == profile:
        return Decision(True)
    op = "replace" if "schedulerName" in spec else "add"
    return Decision(True, patch=({"op": op, "path": "/spec/schedulerName", "value": profile},))


def review(body: Any, default_profile: str) -> dict[str, Any]:
    """An AdmissionReview request in, the AdmissionReview response out. Never raises: a request it cannot read is
    answered with allowed=false and the reason (the API server then applies the webhook's failurePolicy only to
    calls that fail, not to answers, so the message reaches the user)."""
    request = body.get("request") if isinstance(body, Mapping) else None
    uid = request.get("uid", "") if isinstance(request, Mapping) else ""
    uid = uid if isinstance(uid, str) else ""
    if not isinstance(request, Mapping) or not uid:
        decision = Decision(False, "alnair: not an admission.k8s.io/v1 AdmissionReview request")
    else:
        kind = _map(request.get("kind")).get("kind")
        pod = request.get("object")
        if kind != "Pod" or request.get("operation") != "CREATE" or not isinstance(pod, Mapping):
            decision = Decision(True)  # the configuration only sends pod CREATE; anything else passes untouched
        else:
            try:
                decision = decide(pod, default_profile)
            except Exception as e:  # a bug must answer, not drop the API server's call
                log.exception("webhook_failed")
                decision = Decision(False, f"alnair-scheduler webhook internal error: {type(e).__name__}: {e}")
    response: dict[str, Any] = {"uid": uid, "allowed": decision.allowed}
    if not decision.allowed:
        response["status"] = {"code": 403, "reason": "Forbidden", "message": decision.message}
    elif decision.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(list(decision.patch)).encode()).decode()
    if isinstance(request, Mapping):
        meta = _map(_map(request.get("object")).get("metadata"))
        name = str(meta.get("name") or meta.get("generateName") or "")
        if not decision.allowed:
            log.warning("webhook_denied", namespace=request.get("namespace"), pod=name, message=decision.message)
        elif decision.patch:
            log.info("webhook_routed", namespace=request.get("namespace"), pod=name,
                     scheduler=decision.patch[0]["value"])
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


# -- TLS ------------------------------------------------------------------------------------------------------------

def self_signed(dns_names: list[str], folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate (P-256, 10 years) for `dns_names`, made with the openssl command; (cert, key)."""
    cert, key = folder / "tls.crt", folder / "tls.key"
    san = ",".join(f"DNS:{n}" for n in dns_names)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "3650", "-subj", f"/CN={dns_names[0]}", "-addext", f"subjectAltName={san}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, text=True)
    os.chmod(key, 0o600)
    return cert, key


def tls_context(cert: Path | None, key: Path | None, dns_names: list[str]) -> tuple[ssl.SSLContext, bytes]:
    """The server's TLS context and the PEM of its certificate (the caBundle when self-signed). With `cert` and
    `key` (a kubernetes.io/tls Secret mounted as files) they are used; else a self-signed certificate is made."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is None or key is None:
        with tempfile.TemporaryDirectory(prefix="alnair-webhook-") as tmp:  # the key lives on in memory only
            cert, key = self_signed(dns_names, Path(tmp))
            ctx.load_cert_chain(str(cert), str(key))
            return ctx, cert.read_bytes()
    ctx.load_cert_chain(str(cert), str(key))
    return ctx, cert.read_bytes()


async def publish_ca_bundle(api: Any, pem: bytes, name: str = WEBHOOK_CONFIGURATION) -> int:
    """Write `pem` as the caBundle of every webhook of MutatingWebhookConfiguration `name` (JSON patch, by index,
    after reading it); the number of webhooks patched."""
    from kubernetes_asyncio.client import AdmissionregistrationV1Api

    from alnair_agent.kube.client import read_json

    admission = AdmissionregistrationV1Api(api)
    config = await read_json(await admission.read_mutating_webhook_configuration(name, _preload_content=False))
    bundle = base64.b64encode(pem).decode()
    patch = [{"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle}
             for i in range(len(config.get("webhooks") or ()))]
    if patch:
        await read_json(await admission.patch_mutating_webhook_configuration(
            name, patch, _content_type="application/json-patch+json", _preload_content=False))
    log.info("webhook_ca_bundle_published", configuration=name, webhooks=len(patch))
    return len(patch)


# -- HTTPS server ---------------------------------------------------------------------------------------------------

def build_webhook_app(default_profile: str) -> Any:
    from aiohttp import web

    async def mutate(request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except Exception as e:  # noqa: BLE001 - any unreadable review is refused with a message, not a 500
            body = None
            log.warning("webhook_bad_request", error=f"{type(e).__name__}: {e}")
        return web.json_response(review(body, default_profile))

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/mutate", mutate)
    return app


async def serve_webhook(host: str, port: int, ssl_context: ssl.SSLContext | None, default_profile: str) -> None:
    """Serve POST /mutate over HTTPS until cancelled."""
    import asyncio

    from aiohttp import web

    from alnair_agent import http_stop

    runner = web.AppRunner(build_webhook_app(default_profile), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
        log.info("webhook_listening", addresses=[f"{a[0]}:{a[1]}" for a in runner.addresses if isinstance(a, tuple)],
                 tls=ssl_context is not None, default_profile=default_profile)
        await asyncio.Event().wait()
    finally:
        await http_stop.stop(runner)


async def keep_ca_bundle_published(api: Any, pem: bytes, name: str = WEBHOOK_CONFIGURATION) -> None:
    """Publish the self-signed certificate as caBundle, retrying (1 s doubling to 30 s) until it is written; then
    wait until cancelled (a service of the scheduler's TaskGroup)."""
    import asyncio

    delay = 1.0
    while True:
        try:
            await publish_ca_bundle(api, pem, name)
            break
        except Exception as e:  # noqa: BLE001 - retried with backoff whatever failed; the webhook serves meanwhile
            log.warning("webhook_ca_bundle_failed", configuration=name, error=f"{type(e).__name__}: {e}",
                        retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(30.0, delay * 2)
    await asyncio.Event().wait()
