"""``python -m coalesced_int4 ...``: see ``coalesced_int4.cli``."""

from coalesced_int4.cli import main

raise SystemExit(main())
