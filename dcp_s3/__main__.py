import sys

from dcp_s3._cli.commands import main

sys.exit(main())
