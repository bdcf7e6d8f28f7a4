"""Daemon messages as the client's session link hands them on: a test
builds the protobuf message the daemon would send and converts it at the
client's edge (`ec_client.common.wire`), as the link does."""

from __future__ import annotations

from typing import Any

from ec_client.common.wire import DaemonNews, daemon_news
from ec_protocol.protocol import pb


def news(**fields: Any) -> DaemonNews:
    """A DaemonMessage of `fields`, converted."""
    return daemon_news(pb.DaemonMessage(**fields))
