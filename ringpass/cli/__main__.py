"""``python -m ringpass.cli``: the ``ringpass`` command."""

import sys

from ringpass.cli import main

sys.exit(main())
