"""Start-up and shutdown of the serving daemon.

Order matters for operators: everything that can fail for a reason they can
fix (socket path, stale files, tmpfs size) is checked before the region is
pre-faulted, and each failure is one line. A region a previous daemon on
the same socket left is adopted when it fits the flags (`adoption`: a warm
restart); the log line that follows says what was adopted, or why not. On
SIGTERM or SIGINT the daemon stops accepting, ends the session streams, lets
in-flight calls finish, removes its socket, and leaves its region for the
next start to adopt (or removes it: `--on-exit remove`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ec_daemon.core.cache import Cache, CacheListener
from ec_daemon.core.limits import SHM_WAIT_SECONDS, SHUTDOWN_GRACE_SECONDS
from ec_daemon.core.quotas import PendingCaps
from ec_daemon.core.sessions import SessionTable
from ec_daemon.durable.region import PREFIX, SUFFIX, Region, RegionError, RegionTooLarge
from ec_daemon.errors import InvariantViolated
from ec_daemon.plane.dataplane import DataPlane
from ec_daemon.serving.adoption import Adoption, RegionSpec, find
from ec_daemon.serving.auth import (
    READ_ONLY_SUMMARY,
    AuthError,
    apply_access,
    open_folder_to_group,
    resolve_group,
    token_interceptor,
)
from ec_daemon.serving.config import DaemonConfig
from ec_daemon.serving.metrics import start_exporter
from ec_daemon.serving.service import ECDaemonService
from ec_daemon.serving.startup import StartupError, prepare_socket
from ec_protocol import stamps
from ec_protocol.protocol import default_socket_uri, pb, rpc, unix_path
from ec_protocol.sizes import format_size

if TYPE_CHECKING:  # (imported only when --remote is set: `_start_tier`)
    from ec_daemon.remote.tier import RemoteTier

log = logging.getLogger("ec_daemon")

SERVICE_NAME = "ec_daemon.v1.ECDaemon"


def sd_notify(state: str) -> bool:
    """Tell systemd (Type=notify) about our state; a no-op elsewhere."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(state.encode(), address)
        except OSError as exc:
            log.warning("cannot notify systemd at %s: %s", address, exc.strerror)
            return False
    return True


async def serve(config: DaemonConfig, *, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set). Raises StartupError."""
    socket_path = unix_path(config.socket)
    try:
        gid = resolve_group(config.group)
        interceptor = token_interceptor(config.token_file, config.read_token_file)
    except AuthError as exc:
        raise StartupError(str(exc)) from None
    if socket_path is None and interceptor is None:
        raise StartupError(f"refusing to listen on TCP {config.socket} without --token-file "
                           "(every call must carry the token); use a unix:// socket or "
                           "give a token")
    if socket_path is not None and config.tls_cert:
        raise StartupError("--tls-cert/--tls-key apply to TCP sockets only")
    target, lock = prepare_socket(config.socket, gid)
    server = grpc.aio.server(interceptors=[interceptor] if interceptor else None)
    try:
        _bind(server, target, config)  # before pre-faulting: fail fast
    except BaseException:
        lock.release()
        raise
    try:
        if socket_path is not None:
            try:
                apply_access(socket_path, config.socket_mode, gid)
                open_folder_to_group(Path(socket_path).parent, gid)
            except AuthError as exc:
                raise StartupError(str(exc)) from None
        capacity = config.cpu_bytes // config.page_bytes * config.page_bytes
        data_offset = stamps.table_bytes(capacity // config.page_bytes, config.page_bytes)
        spec = RegionSpec(socket_identity(config.socket), data_offset + capacity,
                        config.page_bytes, data_offset, config.socket_mode, gid)
        found = find(config.shm_dir, spec,
                     fresh_start=config.fresh_start or not config.warm_restart)
        adoption, why_not = found.adoption, found.why_not
        if not config.warm_restart:
            why_not = "--warm-restart false"
        if adoption is not None:
            log.log(logging.WARNING if adoption.corrupt else logging.INFO, "%s",
                    adoption.summary())
            region = adoption.region  # its mode and group are the flags' (`adoption`)
        else:
            log.log(logging.WARNING if found.refused else logging.INFO,
                    "starting with an empty cache: %s", why_not)
            region = await _create_region(config, spec, gid)
        remove = config.on_exit == "remove" or not config.warm_restart
        try:
            await _serve_region(config, server, region, data_offset, stop or asyncio.Event(),
                                adoption, found.counters())
        finally:
            region.close(remove=remove)
        if remove:
            log.info("stopped; region %s removed", region.path)
        else:
            log.info("stopped; region %s kept for the next start on %s to adopt "
                     "(--on-exit remove to delete it)", region.path, config.socket)
    finally:
        await server.stop(None)
        if socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(socket_path)
        lock.release()


def socket_identity(uri: str) -> str:
    """The socket a region belongs to, as its index records it: a Unix
    socket by its absolute path with its folder's links resolved (/var/run
    and /run name one socket), TCP as given."""
    path = unix_path(uri)
    if path is None:
        return uri
    folder, name = os.path.split(os.path.abspath(path))
    return f"unix://{os.path.join(os.path.realpath(folder), name)}"


async def _create_region(config: DaemonConfig, spec: RegionSpec, gid: int | None) -> Region:
    """Create the region; while the tmpfs is short, wait up to
    SHM_WAIT_SECONDS (after a restart, clients still map the previous
    daemon's region for a few seconds), saying so. Raises StartupError."""
    deadline = time.monotonic() + SHM_WAIT_SECONDS
    said = 0.0
    while True:
        try:
            return Region.create(config.shm_dir, spec.region_size, mode=config.socket_mode,
                                 gid=gid, progress=log.info,
                                 index_header=spec.header if config.warm_restart else None)
        except RegionTooLarge as exc:
            now = time.monotonic()
            if now >= deadline:
                raise StartupError(f"{exc}{_other_regions(config.shm_dir)}") from None
            if now - said >= 5:
                said = now
                log.warning("%s; waiting up to %.0fs for clients of a previous daemon to "
                            "unmap its region", exc, deadline - now)
            await asyncio.sleep(0.5)
        except (RegionError, OSError) as exc:
            raise StartupError(str(exc)) from None


def _other_regions(shm_dir: str) -> str:
    """What else holds the tmpfs, for the error of a region that does not fit."""
    sizes = []
    for path in Path(shm_dir).glob(f"{PREFIX}*{SUFFIX}"):
        with contextlib.suppress(OSError):
            sizes.append(os.lstat(path).st_blocks * 512)
    if not sizes:
        return ""
    return (f"; {len(sizes)} region file(s) of other or stopped daemons hold "
            f"{format_size(sum(sizes))} there (a stopped daemon's region stays for its next "
            "start: `ec-daemon clean --all` removes those of stopped daemons)")


def _start_tier(config: DaemonConfig) -> RemoteTier | None:
    """The second tier's threads, or None when --remote is off. The URL's
    scheme chooses the backend, once (`remote.tier.open_tier`). A store that
    cannot be reached now is not fatal: the tier keeps trying (misses
    meanwhile)."""
    if not config.remote:
        return None
    from ec_daemon.remote.tier import open_tier

    try:
        tier = open_tier(config.remote, token_file=config.remote_token_file,
                         ttl_s=config.remote_ttl_seconds,
                         publish_queue_bytes=config.remote_queue_bytes,
                         index_bytes=config.remote_index_bytes,
                         promotion_bytes=config.remote_promotion_bytes,
                         claim_s=config.remote_claim_seconds)
    except (ValueError, OSError) as exc:
        raise StartupError(f"--remote: {exc}") from None
    tier.start()
    log.info("second tier %s: %s", _redacted(config.remote), tier.backend.describe())
    return tier


def engine_config(config: DaemonConfig) -> str:
    """The `--ec-transfer-config` a vLLM engine passes to reach this daemon,
    as JSON to paste: the socket absolute, and for TCP the token file (and
    the certificate, as the CA of a self-signed one) the flags name."""
    path = unix_path(config.socket)
    extra = {"ec_daemon_socket": f"unix://{os.path.abspath(path)}" if path is not None
             else config.socket}
    if path is None and config.token_file:
        extra["ec_daemon_token_file"] = os.path.abspath(config.token_file)
    if path is None and config.tls_cert:
        extra["ec_daemon_tls_ca"] = os.path.abspath(config.tls_cert)
    return json.dumps({"ec_connector": "ECDaemonConnector", "ec_role": "ec_both",
                       "ec_connector_extra_config": extra})


def _redacted(url: str) -> str:
    """A URL without any password it carries."""
    return re.sub(r"//[^@/]*@", "//***@", url)


def _bind(server: grpc.aio.Server, target: str, config: DaemonConfig) -> None:
    credentials = None
    if config.tls_cert:
        try:
            credentials = grpc.ssl_server_credentials(
                [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())])
        except OSError as exc:
            raise StartupError(f"cannot read TLS key or certificate: {exc}") from None
    old_umask = os.umask(0o177)  # the socket is born owner-only
    try:
        if credentials is not None:
            server.add_secure_port(target, credentials)
        else:
            server.add_insecure_port(target)
    except RuntimeError:
        raise StartupError(f"cannot listen on {config.socket}: address in use or not "
                           "permitted") from None
    finally:
        os.umask(old_umask)
    if unix_path(config.socket) is None:
        log.info("listening on TCP %s (%s, token required%s)", target,
                 "TLS" if credentials is not None else "no TLS",
                 f"; read-only token for {READ_ONLY_SUMMARY}" if config.read_token_file else "")


async def _serve_region(config: DaemonConfig, server: grpc.aio.Server, region: Region,
                        data_offset: int, stop: asyncio.Event,
                        adoption: Adoption | None, adoption_counters: dict[str, int]) -> None:
    table = region.stamps(config.page_bytes, data_offset)  # never mapped: `stamp_file`
    sessions = SessionTable(config.lease_seconds, max_sessions=config.max_sessions,
                            max_per_engine=config.max_sessions_per_engine,
                            max_tokenless=config.max_tokenless_sessions)
    caps = PendingCaps(config.session_pending_bytes, config.session_pending_entries,
                       config.total_pending_bytes)

    def make_cache(listener: CacheListener) -> Cache:
        return Cache(capacity_bytes=region.size - data_offset, page_bytes=config.page_bytes,
                     sessions=sessions, data_offset=data_offset, stamps=table,
                     index=region.index, quarantine_seconds=config.quarantine_seconds,
                     ack_wait_seconds=config.ack_wait_seconds, pending_caps=caps,
                     listener=listener)

    region_info = pb.Region(path=str(region.path), size_bytes=region.size,
                            page_bytes=config.page_bytes, generation=region.generation,
                            data_offset=data_offset, canary=region.canary)
    tier = _start_tier(config)
    plane = DataPlane(make_cache, lease_seconds=config.lease_seconds,
                      alloc_wait_seconds=config.alloc_wait_seconds,
                      check_invariants=config.check_invariants,
                      generation=region.generation, region_path=str(region.path),
                      max_watchers=config.max_watchers,
                      max_watchers_per_peer=config.max_watchers_per_peer,
                      region_file=region, tier=tier, adoption=adoption_counters)
    cache = plane.cache
    if region.index is not None:
        region.index.flush_with(asyncio.get_running_loop().call_soon)
    if adoption is not None:
        v = adoption.verified
        cache.restore(v.records, v.free, v.quarantined, v.next_entry_id, v.views,
                      cache.sessions.previous_daemon)
    service = ECDaemonService(plane, region_info)
    try:
        plane.verify()  # with --check-invariants: an adopted region is checked whole
    except InvariantViolated as exc:
        raise StartupError(str(exc)) from None
    health_service = health.aio.HealthServicer()
    rpc.add_ECDaemonServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    await server.start()
    cache.acks.serving()
    for name in ("", SERVICE_NAME):
        await health_service.set(name, health_pb2.HealthCheckResponse.SERVING)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    expiry = asyncio.ensure_future(plane.upkeep.run())
    cutting = asyncio.ensure_future(service.streams.upkeep())
    exporter = None
    if config.metrics_port:
        try:
            collectors = [service.rpc_seconds] if tier is None else [service.rpc_seconds, tier]
            exporter = start_exporter(plane.snapshot, loop, config.metrics_port,
                                      config.metrics_address, collectors)
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {config.metrics_address}:"
                               f"{config.metrics_port}: {exc.strerror}") from None
        log.info("metrics on http://%s:%d/metrics", config.metrics_address, config.metrics_port)
    log.info("ec-daemon serving on %s: region %s, %s in %d pages of %s, generation %016x, "
             "lease %.0fs", config.socket, region.path, format_size(cache.capacity_bytes),
             cache.allocator.total_pages, format_size(config.page_bytes), region.generation,
             config.lease_seconds)
    log.info("vLLM engines reach it with --ec-transfer-config '%s'%s", engine_config(config),
             " (the default socket: engines of this user, with the same $XDG_RUNTIME_DIR, "
             "may leave ec_daemon_socket out)" if config.socket == default_socket_uri() else "")
    sd_notify(f"READY=1\nSTATUS=serving {format_size(cache.capacity_bytes)} on {config.socket}")
    try:
        await stop.wait()
    finally:
        sd_notify("STOPPING=1")
        log.info("shutting down: draining calls, ending %d sessions", len(cache.sessions))
        expiry.cancel()
        cutting.cancel()
        if exporter is not None:
            exporter.shutdown()
        await health_service.enter_graceful_shutdown()
        plane.close_streams()
        await server.stop(SHUTDOWN_GRACE_SECONDS)
        if tier is not None:
            tier.stop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
