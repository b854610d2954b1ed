import sys

from qcore.cli import main

sys.exit(main())
