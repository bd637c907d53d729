"""The long-running daemon: production watcher, drift detection, scheduling, publishing."""
