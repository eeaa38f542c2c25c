"""What a cell is and carries: its source, its names, its options, its place. Runs in the kernel and in each host's engine."""
