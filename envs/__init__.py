"""Multi-turn text environments (TextWorld, ALFWorld, SWE-style tasks) that the agent loop plays."""
