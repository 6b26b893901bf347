from flashtree.cli import main

raise SystemExit(main())
