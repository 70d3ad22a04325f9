"""The Llama-family model and its checkpoint I/O."""
