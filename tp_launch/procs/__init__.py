"""Worker processes: spawning, logs, signals and reaping."""
