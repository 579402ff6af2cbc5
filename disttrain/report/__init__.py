"""What a run shows and leaves for people: terminal lines, plots, timing from the command, sweep summaries."""
