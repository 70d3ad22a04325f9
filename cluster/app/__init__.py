"""The roof: the Serve application builder and the `pdserve` CLI."""
