import sys

from optimizer_core.cli.main import main

sys.exit(main())
