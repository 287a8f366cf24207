import sys

from ncgrpo.cli import main

sys.exit(main())
