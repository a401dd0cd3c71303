from quickdraft.cli import main

raise SystemExit(main())
