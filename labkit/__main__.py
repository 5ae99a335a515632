from labkit.app.cli import main

raise SystemExit(main())
