# syntax=docker/dockerfile:1
# Alnair: one image for the node agent (alnair-agent), the scheduler extender and webhook (alnair-scheduler) and
# the shim (libalnair.so, installed on each node by the agent DaemonSet's init container).
#
#   docker build -t ghcr.io/centaurusinfra/alnair:0.1.0 .
#
# Stage 1 builds the wheel exactly as `pip install .` does (setup.py: gRPC code from alnair_agent/proto, the shim
# through shim/Makefile, with the toolchain the project's build declares), and the wheels of its dependencies.
# Stage 2 is a slim runtime: the installed package, the shim at a fixed path, a non-root user.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential make \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py setup.cfg README.md ./
COPY alnair_agent/ alnair_agent/
COPY alnair_standins/ alnair_standins/
COPY shim/ shim/
RUN pip wheel --no-cache-dir --wheel-dir /wheels . \
 && python -c "import zipfile, glob, sys; w = glob.glob('/wheels/alnair-*.whl'); \
names = zipfile.ZipFile(w[0]).namelist(); \
sys.exit(0 if 'alnair_agent/lib/libalnair.so' in names else 'wheel has no libalnair.so')"

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="alnair" \
      org.opencontainers.image.description="Share NVIDIA GPUs between Kubernetes pods with enforced limits" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/CentaurusInfra/alnair"
# openssl: alnair-scheduler makes the webhook's self-signed certificate with it when no Secret provides one
RUN apt-get update \
 && apt-get install -y --no-install-recommends openssl \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-index --find-links /tmp/wheels alnair \
 && rm -rf /tmp/wheels \
 && install -D -m 0755 "$(python -c 'import alnair_agent.shim_install as s; print(s.packaged_shim())')" \
      /opt/alnair/lib/libalnair.so \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin alnair \
 && alnair-agent --version && alnair-scheduler --help >/dev/null
# alnair-scheduler runs as this user. The agent's DaemonSet runs it as root (runAsUser: 0): it serves kubelet's
# device plugin sockets in a root-owned host folder and reads /proc of other containers' processes.
USER 10001
ENV PYTHONUNBUFFERED=1
CMD ["alnair-agent"]
