import sys

from autotune.cli import main

# guarded: a replay worker process (spawned) imports this module again, and must not run the command a second time
if __name__ == "__main__":
    sys.exit(main())
