"""``python -m precisiondiff.cli``."""
from .app import main

main()
