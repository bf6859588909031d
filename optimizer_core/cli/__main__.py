import sys

from graphtrim.cli.main import main

sys.exit(main())
