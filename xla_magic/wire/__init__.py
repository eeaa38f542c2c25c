"""What the kernel and the ranks both speak: events and framing (protocol), shared-memory segments (transport),
and a profile's digest (trace). Runs on both sides; imports nothing else of xla_magic."""
