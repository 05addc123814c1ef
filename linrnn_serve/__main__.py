import sys

from linrnn_serve.cli import main

sys.exit(main())
