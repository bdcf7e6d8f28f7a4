# syntax=docker/dockerfile:1
# The ec-daemon sidecar image: the daemon only (grpcio, protobuf,
# prometheus-client); no torch, no CUDA. Runs as a non-root user.
#
#   docker build -t ec-daemon .
#   docker run --shm-size=9g -v ec-socket:/run/ec-daemon ec-daemon --cpu-bytes 8GiB

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY ec_daemon ./ec_daemon
COPY ec_protocol ./ec_protocol
# The package build generates the protocol stubs (grpcio-tools, build-time only).
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin ecd \
 && mkdir -p /run/ec-daemon && chown ecd:ecd /run/ec-daemon
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER ecd
ENV EC_DAEMON_SOCKET=unix:///run/ec-daemon/ec.sock \
    EC_DAEMON_CPU_BYTES=8GiB \
    EC_DAEMON_METRICS_ADDRESS=0.0.0.0 \
    PYTHONUNBUFFERED=1
VOLUME /run/ec-daemon
EXPOSE 9400
HEALTHCHECK --interval=5s --timeout=3s --start-period=120s --retries=3 \
  CMD ["ec-daemon", "health"]
ENTRYPOINT ["ec-daemon"]
CMD ["--metrics-port", "9400"]
