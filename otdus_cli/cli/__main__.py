"""`python -m otdus_cli.cli`: the same command line as `otdus`."""

from otdus_cli.cli import main

main()
