"""RL harness: configs, the agent loop over environments and engine streams, and rollout records
handed to the trainer."""
