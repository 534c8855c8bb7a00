import sys

from mima.cli import main

sys.exit(main())
