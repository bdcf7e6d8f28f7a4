import sys

from ec_daemon.serving.cli import main

sys.exit(main())
