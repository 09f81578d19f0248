"""`python -m keras_distribute.planning train.py --hosts 4 ...`: a dry run
of the job (`command_line`)."""

import sys

from keras_distribute.planning.command_line import main

sys.exit(main())
