"""The demo (``make demo``, ``python -m graphtrim.demo [OUT_DIR]``): graphtrim on a small model
from start to end, for a person to read.

It sits above the orchestrator adapters (it drives the Airflow DAG and uses the example models),
so that the adapters themselves import no examples. :mod:`graphtrim.demo.run` is the demo,
:mod:`graphtrim.demo.console` what its terminal shows (graphtrim's own lines; everything else
goes to the log file whose path it prints first).
"""

from __future__ import annotations
