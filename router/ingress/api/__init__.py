"""API edges: wire formats <-> ClientRequest / Delta, nothing else."""
