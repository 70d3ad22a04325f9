"""P/D orchestration, no policy: route -> first token -> decode legs, migration, relay."""
