"""What a run writes and reads back: the output directory, atomic files, checkpoints and their restricted loader, the
dashboard, plots, log lines and the job's log summary."""
