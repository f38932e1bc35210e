"""``harts`` subcommands, one module each (see ``harts.cli``)."""
