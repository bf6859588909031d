"""``python -m graphtrim.demo [OUT_DIR] [--without-airflow]``"""

from __future__ import annotations

import sys

from graphtrim.demo.run import main

sys.exit(main())
