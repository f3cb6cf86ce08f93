"""``python -m precisiondiff`` (so ``torchrun -m precisiondiff capture ...``), the CLI face."""
from .cli.app import main

if __name__ == "__main__":
    main()
