"""`python -m aqpipe TASK [flags]`: see aqpipe.cli."""
from .cli import leave, main

leave(main())
