"""``python -m precisiondiff.cli``."""
from . import main

main()
