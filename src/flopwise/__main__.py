from flopwise.cli import main

raise SystemExit(main())
