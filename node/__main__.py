"""`python -m node` is the `tenzro` command, for environments where the script is not installed."""

from node.cli import main

main()
