import sys

from bench.isolation.run import main

sys.exit(main())
