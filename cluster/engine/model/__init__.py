"""The served model families, the decoder built from shared blocks, and checkpoint I/O."""
