import sys

from passthrough.cli import main

sys.exit(main())
