"""Files on disk, known by their formats alone: written whole (atomic), checkpoints and weights with their digests
and restricted loader, the dashboard, plots, the report, log lines and events, and the job's log summary."""
