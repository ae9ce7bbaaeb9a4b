"""``python -m ascend_patch`` is the ``ascend-patch`` command."""

from ascend_patch.cli import main

raise SystemExit(main())
