"""`ec-daemon`: serve (the default), `health`, `stats`, `events` and `clean`.

    ec-daemon [serve] --cpu-bytes 64GiB --socket unix:///run/ec-daemon/ec.sock
    ec-daemon health [--socket URI]      exit 0 only when the daemon serves
    ec-daemon stats [--socket URI] [--json]
    ec-daemon events [--socket URI] [--namespace NS] [--json]   until Ctrl-C
    ec-daemon clean [--socket URI | --all] [--shm-dir DIR]   remove stopped daemons' regions

Flags of `serve` come from the settings table in `config` (each with an
EC_DAEMON_* environment fallback). Errors are one line on stderr and a
non-zero exit: 2 for bad flags or a daemon that cannot start, 1 for a
daemon that is not serving.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ec_daemon import __version__
from ec_daemon.durable.dead import clean_stale
from ec_daemon.serving import config
from ec_daemon.serving.server import SERVICE_NAME, StartupError, serve, socket_identity
from ec_protocol.protocol import ROLE_NAMES, default_socket_uri, pb, rpc
from ec_protocol.sizes import format_size
from ec_protocol.transport import Transport

COMMANDS = ("serve", "health", "stats", "events", "clean")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args and args[0] in COMMANDS else "serve"
    return {"serve": _serve, "health": _health, "stats": _stats,
            "events": _events, "clean": _clean}[command](args)


def _fail(message: str, code: int = 2) -> int:
    print(f"ec-daemon: error: {message}", file=sys.stderr)
    return code


def _serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ec-daemon", description="Serve a shared CPU encoder cache for vLLM engines. "
        "Other commands: `ec-daemon health`, `ec-daemon stats`, `ec-daemon events`, "
        "`ec-daemon clean`.")
    parser.add_argument("--version", action="version", version=f"ec-daemon {__version__}")
    config.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        settings = config.from_namespace(args)
    except ValueError as exc:
        return _fail(str(exc))
    configure_logging(settings.log_level, settings.log_format)
    try:
        asyncio.run(serve(settings))
    except StartupError as exc:
        return _fail(str(exc))
    return 0


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def _clean(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ec-daemon clean", description="Remove the regions stopped daemons left in the "
        "tmpfs for their next start (a warm restart), freeing their memory. Regions of "
        "running daemons and other users' files are never touched.")
    config.add_arguments(parser, ("socket", "shm_dir"))
    parser.add_argument("--all", action="store_true",
                        help="every stopped daemon's region, whatever its socket")
    args = parser.parse_args(argv)
    socket = None if args.all else socket_identity(args.socket)
    removed = clean_stale(args.shm_dir, socket)
    for path in removed:
        print(f"removed {path}")
    if not removed:
        print(f"no region of a stopped daemon{'' if args.all else ' on ' + args.socket} "
              f"in {args.shm_dir}")
    return 0


def _client_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"ec-daemon {prog}", description=description)
    parser.add_argument("--socket", default=default_socket_uri(),
                        help="daemon address (env EC_DAEMON_SOCKET; default %(default)s)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    parser.add_argument("--token-file", default=None,
                        help="token for a TCP daemon: its --token-file or, enough for this "
                        "command, its --read-token-file (env EC_DAEMON_TOKEN_FILE)")
    parser.add_argument("--tls-ca", default=None,
                        help="CA certificate for a TLS daemon (env EC_DAEMON_TLS_CA)")
    return parser


def _transport(args: argparse.Namespace) -> Transport:
    return Transport(args.socket, args.timeout, token_file=args.token_file, tls_ca=args.tls_ca)


def _health(argv: list[str]) -> int:
    args = _client_parser("health", "Exit 0 when the daemon is serving.").parse_args(argv)
    try:
        transport = _transport(args)
        try:
            reply = health_pb2_grpc.HealthStub(transport.channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=args.timeout,
                metadata=transport.metadata)
        finally:
            transport.close()
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    except grpc.RpcError as exc:
        return _fail(f"daemon at {args.socket} is not reachable: {exc.code().name}", 1)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return _fail(f"daemon at {args.socket} is {status}", 1)
    print(f"{args.socket}: {status}")
    return 0


def _stats(argv: list[str]) -> int:
    parser = _client_parser("stats", "Print the daemon's cache statistics.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        transport = _transport(args)
        try:
            reply = transport.call("Stats", pb.StatsRequest())
        finally:
            transport.close()
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    except grpc.RpcError as exc:
        return _fail(f"daemon at {args.socket} is not reachable: {exc.code().name}", 1)
    data = stats_dict(reply)
    print(json.dumps(data, indent=2) if args.json else format_stats(data))
    return 0


def stats_dict(reply: Any) -> dict[str, Any]:
    """The StatsReply as plain JSON-able values (ints stay ints)."""
    data: dict[str, Any] = {}
    for field in reply.DESCRIPTOR.fields:
        if field.name in ("namespaces", "session_list"):
            continue
        value = getattr(reply, field.name)
        data[field.name] = dict(sorted(value.items())) if field.message_type is not None \
            and field.message_type.GetOptions().map_entry else value
    data["namespaces"] = [
        {f.name: getattr(ns, f.name) for f in ns.DESCRIPTOR.fields} for ns in reply.namespaces]
    data["session_list"] = [
        {**{f.name: getattr(s, f.name) for f in s.DESCRIPTOR.fields},
         "role": ROLE_NAMES.get(s.role, "unknown")} for s in reply.session_list]
    return data


def format_stats(data: dict[str, Any]) -> str:
    size = format_size
    lookups = data["hits"] + data["misses"]
    rate = f"{100 * data['hits'] / lookups:.1f}%" if lookups else "n/a"
    used_pct = 100 * data["used_bytes"] // max(1, data["capacity_bytes"])
    lines = [
        f"capacity   {size(data['capacity_bytes'])} ({size(data['page_bytes'])} pages), "
        f"generation {data['generation']:016x}",
        f"used       {size(data['used_bytes'])} ({used_pct}%): "
        f"pending {size(data['pending_bytes'])}, hidden {size(data['hidden_bytes'])}, "
        f"quarantined {size(data['quarantined_bytes'])}",
        f"entries    {data['entries']} ready, {data['hidden_entries']} hidden",
        f"hit rate   {rate} ({data['hits']} hits, {data['misses']} misses)",
        f"traffic    {data['saves']} saves ({size(data['bytes_saved'])}), {data['loads']} loads "
        f"({size(data['bytes_loaded'])}), {data['evictions']} evictions, "
        f"{data['refused_saves']} refused saves, {data['capped_saves']} over a session's "
        f"pending cap",
        f"sessions   {data['sessions']} ({data['ghost_sessions']} ghosts, "
        f"{data['refused_attaches']} attaches refused, {data['preempted_sessions']} preempted, "
        f"{data['ack_timeouts']} ended for withheld acknowledgements, "
        f"{data['stalled_streams']} streams ended unread)",
        f"watchers   {data['watchers']} ({data['dropped_watchers']} dropped as too slow)",
    ]
    conv = data.get("convergence") or {}
    if conv.get("wants"):
        lines.append(
            f"wanted     {conv['wants']} items: {conv.get('claims', 0)} claimed to encode, "
            f"{conv.get('waits', 0)} waits, {conv.get('releases', 0)} released, "
            f"{conv.get('handovers', 0)} handed over, "
            f"{conv.get('promotions', 0)} promoted ({size(conv.get('promoted_bytes', 0))}), "
            f"{conv.get('promotion_failures', 0)} promotions failed")
    tier = data.get("remote_tier") or {}
    if tier:
        lines.append(
            f"2nd tier   {'reachable' if tier.get('reachable') else 'UNREACHABLE'}: "
            f"{int(tier.get('publishes', 0))} published "
            f"({size(int(tier.get('publish_bytes', 0)))}), "
            f"{int(tier.get('publish_drops', 0))} dropped, "
            f"{int(tier.get('remote_hits', 0))} fetched "
            f"({size(int(tier.get('fetch_bytes', 0)))}), "
            f"{int(tier.get('remote_misses', 0))} missing, "
            f"{int(tier.get('bad_values', 0))} bad values, "
            f"{int(tier.get('index_entries', 0))} entries indexed "
            f"({size(int(tier.get('index_bytes', 0)))}), promotions holding "
            f"{size(int(tier.get('promotion_bytes', 0)))} (peak "
            f"{size(int(tier.get('promotion_bytes_peak', 0)))}, "
            f"{int(tier.get('promotions_refused', 0))} refused for room)")
    for s in data["session_list"]:
        lines.append(f"  #{s['session_index']:<10} {s['engine_id']:<24} {s['component']:<14} "
                     f"{s['role']:<8} awaiting {s['awaiting']:<5} pending {s['pending']}")
    if data["sessions_not_listed"]:
        lines.append(f"  ... and {data['sessions_not_listed']} more sessions (not listed)")
    top = sorted(data["namespaces"], key=lambda n: n["bytes"], reverse=True)[:5]
    if top:
        lines.append("namespaces (largest first)")
        for ns in top:
            lines.append(f"  {ns['namespace']}: {ns['entries']} entries, {size(ns['bytes'])}, "
                         f"{ns['hits']} hits, {ns['misses']} misses, {ns['loads']} loads")
    more = len(data["namespaces"]) - len(top) + data["namespaces_not_listed"]
    if more:
        lines.append(f"  ... and {more} more namespaces (`ec-daemon stats --json` lists "
                     f"{len(data['namespaces'])})")
    return "\n".join(lines)



def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _events(argv: list[str]) -> int:
    parser = _client_parser(
        "events", "Print what the daemon stores and evicts, one line per event: first the "
        "ready entries (a snapshot), then live events, until Ctrl-C. The message format is "
        "in docs/events.md.")
    parser.add_argument("--namespace", default="",
                        help="only this namespace, as `ec-daemon stats` lists it (default: all)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per line (fields: docs/events.md)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop as on Ctrl-C
    try:
        transport = _transport(args)
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    answered = threading.Event()
    timer: threading.Timer | None = None
    stream: Any = None
    try:
        stream = rpc.ECDaemonStub(transport.channel).Watch(
            pb.WatchRequest(namespace=args.namespace), metadata=transport.metadata)
        # The snapshot's first message comes at once: past --timeout, give up.
        timer = threading.Timer(args.timeout, lambda: answered.is_set() or stream.cancel())
        timer.daemon = True
        timer.start()
        snapshot = True
        entries = 0
        for message in stream:
            answered.set()
            for data in watch_dicts(message, snapshot=snapshot, entries=entries):
                print(json.dumps(data) if args.json else format_event(data), flush=True)
            if snapshot:
                entries += len(message.events)
                snapshot = not message.snapshot_done
        return _fail(f"daemon at {args.socket} ended the event stream", 1)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # piped into `head`, say: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0
    except grpc.RpcError as exc:
        return _watch_failed(args, exc, answered.is_set())
    finally:
        if timer is not None:
            timer.cancel()
        if stream is not None:
            stream.cancel()
        transport.close()


def _watch_failed(args: argparse.Namespace, exc: grpc.RpcError, answered: bool) -> int:
    code, details = exc.code(), exc.details() or ""
    where = f"daemon at {args.socket}"
    if not answered and code == grpc.StatusCode.CANCELLED:
        return _fail(f"{where} did not answer within {args.timeout:g}s", 1)
    if not answered and code == grpc.StatusCode.UNAVAILABLE:
        return _fail(f"{where} is not reachable: {code.name}", 1)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return _fail(f"{where} refused the watch: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return _fail(f"{where} dropped this watcher: {details}", 1)
    verb = "ended the event stream" if answered else "refused the watch"
    return _fail(f"{where} {verb}: {code.name}: {details}", 1)


def watch_dicts(message: Any, *, snapshot: bool, entries: int = 0) -> list[dict[str, Any]]:
    """A WatchMessage as `ec-daemon events --json` prints it, one object per
    event (`snapshot`: the message is part of the snapshot; `entries`: how
    many snapshot events came before it). See docs/events.md."""
    generation = f"{message.generation:016x}"
    out = [{"event": pb.WatchEvent.Kind.Name(e.kind).lower(), "generation": generation,
             "namespace": e.namespace, "mm_hash": e.mm_hash, "entry_id": e.entry_id,
             "nbytes": e.nbytes, "shape": list(e.shape), "dtype": e.dtype,
             "time": round(e.time_unix_ns / 1e9, 6), "snapshot": snapshot}
           for e in message.events]
    if message.snapshot_done:
        out.append({"event": "snapshot_done", "generation": generation,
                    "entries": entries + len(message.events)})
    return out


def format_event(data: dict[str, Any]) -> str:
    """One line of `ec-daemon events` (without --json)."""
    if data["event"] == "snapshot_done":
        return (f"-- snapshot complete: {data['entries']} ready entries (generation "
                f"{data['generation']}); live events follow")
    when = datetime.datetime.fromtimestamp(data["time"], datetime.timezone.utc)
    shape = ",".join(map(str, data["shape"]))
    return (f"{when.isoformat(timespec='microseconds')[:-6]}Z {data['event']:<7} "
            f"{data['mm_hash']} "
            f"id={data['entry_id']} {format_size(data['nbytes'])} "
            f"{data['dtype']}[{shape}] {data['namespace']}")


if __name__ == "__main__":
    sys.exit(main())
