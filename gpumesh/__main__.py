import sys

from gpumesh.cli import main

sys.exit(main())
