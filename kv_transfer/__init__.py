"""Moving KV blocks between engines over NIXL. Importing this package does not import NIXL."""
