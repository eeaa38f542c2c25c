"""Sets of ranks and what they stand on: the launcher's client, placements, policies, names. Runs in the kernel and in each host's engine."""
