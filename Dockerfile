# The ec-daemon sidecar image: the daemon only (ec_daemon, ec_protocol and
# their dependencies from pyproject.toml); no torch, no CUDA, no ec_client.
# Runs as a non-root user.
#
#   docker build -t ec-daemon .
#   docker run --shm-size=9g -v ec-socket:/run/ec-daemon ec-daemon --cpu-bytes 8GiB
#
# `docker stop` sends SIGTERM (the default stop signal): the daemon drains,
# removes its socket and keeps its region (and the region's index) in /dev/shm
# for the next start to adopt (EC_DAEMON_ON_EXIT=remove deletes them instead).
# A container's own /dev/shm (--shm-size) does not survive a restart, so the
# cache does not either; a tmpfs volume at /dev/shm that another running
# container (the engine) also mounts does (deploy/compose.yaml).
#
# Without network access (no registry, no PyPI), from a local base image with
# python3 and python3-venv, and a wheelhouse in ./wheels (docs/docker.md):
#
#   python deploy/wheelhouse.py wheels
#   docker build --network none --build-arg BASE=ec-daemon-base:bookworm \
#     --build-arg WHEELHOUSE=1 -t ec-daemon .
#
# No `# syntax=` line: BuildKit would pull that frontend from a registry.
# Works with BuildKit and with the legacy builder.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
# `make docker-clean` finds stale builds of every stage by this label.
LABEL ec-daemon.dockerfile=daemon
# WHEELHOUSE=1: install from ./wheels only (pip --no-index); otherwise from PyPI.
ARG WHEELHOUSE=
WORKDIR /src
# README.md is copied along because COPY needs one source that exists;
# wheel[s] matches the optional ./wheels folder (its wheels land in /wheelhouse).
COPY README.md wheel[s] /wheelhouse/
COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY ec_daemon ./ec_daemon
COPY ec_protocol ./ec_protocol
# A venv in both cases: Debian's python3 is externally managed (PEP 668).
# The package build generates the protocol stubs (grpcio-tools, build-time
# only); pip and setuptools leave the venv afterwards.
RUN set -eu; \
    if [ -n "$WHEELHOUSE" ]; then \
      ls /wheelhouse/*.whl >/dev/null 2>&1 \
        || { echo "WHEELHOUSE is set but ./wheels holds no wheels" >&2; exit 1; }; \
      set -- --no-index --find-links /wheelhouse; \
    fi; \
    python3 -m venv /opt/ec-daemon; \
    /opt/ec-daemon/bin/pip install --no-cache-dir --disable-pip-version-check "$@" .; \
    /opt/ec-daemon/bin/pip uninstall --yes --quiet setuptools pip; \
    /opt/ec-daemon/bin/ec-daemon --help >/dev/null

FROM ${BASE}
LABEL ec-daemon.dockerfile=daemon
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin ecd \
 && mkdir -p /run/ec-daemon && chown ecd:ecd /run/ec-daemon && chmod 0700 /run/ec-daemon
COPY --from=build /opt/ec-daemon /opt/ec-daemon
USER ecd
ENV PATH=/opt/ec-daemon/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    EC_DAEMON_SOCKET=unix:///run/ec-daemon/ec.sock \
    EC_DAEMON_CPU_BYTES=8GiB \
    EC_DAEMON_METRICS_ADDRESS=0.0.0.0 \
    PYTHONUNBUFFERED=1
VOLUME /run/ec-daemon
EXPOSE 9400
HEALTHCHECK --interval=5s --timeout=3s --start-period=120s --retries=3 \
  CMD ["ec-daemon", "health"]
ENTRYPOINT ["ec-daemon"]
CMD ["--metrics-port", "9400"]
