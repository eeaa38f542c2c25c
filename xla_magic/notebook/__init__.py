"""What the user types and sees: the magics, their options, the status panel, every view and the help. Runs in the kernel."""
