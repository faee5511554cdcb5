"""Fleet-scale placement policies of the trace simulator (nodes with CPU, memory and GPUs;
pods with shares or whole GPUs): see registry.py and docs/placement.md."""
