"""Training-job schedulers (Gandiva, OSDI 2018, and its exclusive FIFO baseline): pure
policies over a cluster view, see model.py, registry.py and docs/training.md."""
