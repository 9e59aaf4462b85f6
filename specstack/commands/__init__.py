"""The CLI commands: argparse glue only, one module per command; the library builds through ``specstack.loading``."""
