"""Recipe schema, the run() pipeline, the CLI and the shipped recipes."""
