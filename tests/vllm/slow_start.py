"""A connector whose worker starts its first load late: a slow step.

`ECDaemonConnector`, except that in each worker process the first step that
carries loads (to stage, or staged by the scheduler's process: `inline`)
waits $EC_TEST_SLOW_LOAD_SECONDS before it touches them (after writing
`start` to the file named by $EC_TEST_SLOW_LOAD_MARKER), then goes on as
usual and appends `done`. This is what a worker busy with a long step looks
like from the cache: the load was dispatched long before its copy begins,
and nothing of the region is in use meanwhile. (An idle engine's loads on
vLLM's V1 runner are staged by its scheduler's process, whose copy is done
before the step: there it is the step that uses one that is slow.) Selected
as a deployment selects a connector:
`"ec_connector": "SlowStartConnector", "ec_connector_module_path": "tests.vllm.slow_start"`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ec_client.vllm_connector import ECDaemonConnector, ECDaemonConnectorMetadata
from tests.vllm.slow_copy import MARKER_ENV, SECONDS_ENV


class SlowStartConnector(ECDaemonConnector):
    slowed = False

    def start_load_caches(self, encoder_cache: dict[str, Any], **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        marker = os.environ.get(MARKER_ENV, "")
        if marker and not self.slowed and isinstance(metadata, ECDaemonConnectorMetadata) \
                and (metadata.loads or metadata.inline):
            self.slowed = True
            with open(marker, "x") as out:  # "x": one slow step per test
                out.write("start\n")
            time.sleep(float(os.environ.get(SECONDS_ENV, "0")))
            super().start_load_caches(encoder_cache, **kwargs)
            with open(marker, "a") as out:
                out.write("done\n")
            return
        super().start_load_caches(encoder_cache, **kwargs)
