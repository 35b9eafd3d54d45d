import sys

from mia_stream.broker import main

sys.exit(main(sys.argv[1:]))
