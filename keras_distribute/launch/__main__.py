"""`python -m keras_distribute.launch --nproc N script.py args`."""

import sys

from keras_distribute.launch.script import main

sys.exit(main())
