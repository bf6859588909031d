"""A fault for tests, loaded by every Python process started with this folder on PYTHONPATH:
where ``GRAPHTRIM_TEST_HANG_SERVING`` names a variant and the file
``GRAPHTRIM_TEST_HANG_FLAG`` exists, the serving probe of that variant (a child process of
the validate stage) sleeps until it is killed, as on an overloaded worker. The children must
start interpreters of their own (``GRAPHTRIM_ISOLATION=spawn``): a forked child runs no
``sitecustomize``."""

from __future__ import annotations

import os

_VARIANT = os.environ.get("GRAPHTRIM_TEST_HANG_SERVING")
_FLAG = os.environ.get("GRAPHTRIM_TEST_HANG_FLAG")

# only in the children graphtrim.isolation starts (they carry its step-file variable)
if _VARIANT and _FLAG and os.environ.get("GRAPHTRIM_ISOLATION_STEP_FILE"):
    import time
    from pathlib import Path
    from typing import Any

    from graphtrim.integrations import serving

    _probe = serving.serving_probe

    def _hanging_probe(path: str, *args: Any, **kw: Any) -> Any:
        if Path(path).parent.name == _VARIANT and Path(str(_FLAG)).exists():
            time.sleep(3600)
        return _probe(path, *args, **kw)

    serving.serving_probe = _hanging_probe  # type: ignore[assignment]
