"""`python -m aqpipe TASK [flags]`: see aqpipe.cli."""
import sys

from .cli import main

sys.exit(main())
