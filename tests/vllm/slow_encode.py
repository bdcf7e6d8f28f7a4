"""A connector whose worker, when a test says so, takes long over one encode.

`ECDaemonConnector`, except that a worker's `save_caches` finding the file
named by $EC_TEST_SLOW_ENCODE_TRIGGER renames it to `<trigger>.started`,
sleeps $EC_TEST_SLOW_ENCODE_SECONDS, saves, and then writes
`<trigger>.done`. From the daemon's side that is an encoder instance still
encoding the item: its scheduler has asked about it (a claim), and no save
was asked for yet. Without the trigger file it is the plain connector.
Selected as a deployment selects a connector:
`"ec_connector": "SlowEncodeConnector", "ec_connector_module_path": "tests.vllm.slow_encode"`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ec_client.vllm_connector import ECDaemonConnector

TRIGGER_ENV = "EC_TEST_SLOW_ENCODE_TRIGGER"
SECONDS_ENV = "EC_TEST_SLOW_ENCODE_SECONDS"


class SlowEncodeConnector(ECDaemonConnector):
    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None:
        trigger = Path(os.environ.get(TRIGGER_ENV, "") or "/nonexistent")
        started = trigger.with_name(trigger.name + ".started")
        try:
            trigger.rename(started)  # (only one save per trigger is slow)
        except OSError:
            super().save_caches(encoder_cache, mm_hash, **kwargs)
            return
        time.sleep(float(os.environ.get(SECONDS_ENV, "0")))
        super().save_caches(encoder_cache, mm_hash, **kwargs)
        trigger.with_name(trigger.name + ".done").write_text(mm_hash)
