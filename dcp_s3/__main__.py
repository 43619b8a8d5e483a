import sys

from dcp_s3.cli.commands import main

sys.exit(main())
