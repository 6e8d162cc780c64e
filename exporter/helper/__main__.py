import sys

from exporter.helper.process import main

sys.exit(main())
