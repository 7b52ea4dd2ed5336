import sys

from hf_paged.cli.commands import entry

sys.exit(entry())
